"""An imported image's user, entrypoint and cmd in its sandboxes (container and fncall):
execs run as the image's user, resolved against the image's own /etc/passwd and /etc/group,
`--user` overrides it, `dsec run` without a command starts entrypoint + cmd, and a hostile
passwd file is refused with the file and line named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import Image, file, symlink, write_layout

PASSWD = (b"root:x:0:0:root:/root:/bin/sh\n"
          b"app:x:1000:1000:the app:/home/app:/bin/sh\n"
          b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
GROUP = b"root:x:0:\napp:x:1000:\ndev:x:1500:app,other\nnogroup:x:65534:\n"
BACKENDS = ["container", "fncall"]


def _import(run_dsec, tmp_path: Path, busybox_tar: Path, ref: str,  # type: ignore[no-untyped-def]
            top: list, **config) -> None:  # type: ignore[type-arg]
    img = Image([busybox_tar.read_bytes(), top], ["gzip", "gzip"], env=["PATH=/bin:/usr/bin"],
                workdir="/", **config)
    layout = tmp_path / ref.replace("@", "-")
    write_layout(img, layout)
    run_dsec("import", str(layout), "--as", ref)


def _users(run_dsec, tmp_path: Path, busybox_tar: Path,  # type: ignore[no-untyped-def]
           user: str = "app") -> None:
    _import(run_dsec, tmp_path, busybox_tar, "users@1",
            [file("etc/passwd", PASSWD), file("etc/group", GROUP)],
            user=user, entrypoint=[], cmd=["id"])


def _no_sandboxes(run_dsec) -> None:  # type: ignore[no-untyped-def]
    assert json.loads(run_dsec("ps", "--json").stdout) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_execs_run_as_the_images_user(node: dict[str, str], tmp_path: Path, busybox_tar: Path,
                                      run_dsec, backend: str) -> None:  # type: ignore[no-untyped-def]
    _users(run_dsec, tmp_path, busybox_tar)
    p = run_dsec("run", "--backend", backend, "users@1", "--",
                 "/bin/sh", "-c", "id -u; id -g; echo $HOME; touch /tmp/mine; stat -c %u /tmp/mine")
    assert p.stdout == "1000\n1000\n/home/app\n1000\n"
    if backend == "container":  # supplementary groups from /etc/group
        assert run_dsec("run", "users@1").stdout == \
            "uid=1000(app) gid=1000(app) groups=1000(app),1500(dev)\n"


def test_numeric_user_and_group(node: dict[str, str], tmp_path: Path, busybox_tar: Path,
                                run_dsec) -> None:  # type: ignore[no-untyped-def]
    _users(run_dsec, tmp_path, busybox_tar, user="4242:dev")
    assert run_dsec("run", "users@1").stdout == "uid=4242 gid=1500(dev) groups=1500(dev)\n"


def test_user_overrides(node: dict[str, str], tmp_path: Path, busybox_tar: Path,
                        run_dsec) -> None:  # type: ignore[no-untyped-def]
    _users(run_dsec, tmp_path, busybox_tar)
    assert run_dsec("run", "--user", "nobody", "users@1", "--", "id", "-u").stdout == "65534\n"
    assert run_dsec("run", "-u", "0", "users@1", "--", "id", "-u").stdout == "0\n"
    sid = run_dsec("run", "-d", "users@1").stdout.strip()
    try:
        assert run_dsec("exec", sid, "--", "id", "-u").stdout == "1000\n"
        assert run_dsec("exec", "--user", "root", sid, "--", "id", "-u").stdout == "0\n"
        assert run_dsec("exec", "--user", "app:dev", sid, "--", "id").stdout == \
            "uid=1000(app) gid=1500(dev) groups=1500(dev)\n"
        p = run_dsec("exec", "--user", "mallory", sid, "--", "id", check=2)
        assert "mallory" in p.stderr and "/etc/passwd" in p.stderr
    finally:
        run_dsec("rm", sid)


def test_fncall_refuses_another_user_per_exec(node: dict[str, str], tmp_path: Path,
                                              busybox_tar: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    _users(run_dsec, tmp_path, busybox_tar)
    sid = run_dsec("run", "-d", "--backend", "fncall", "users@1").stdout.strip()
    try:
        assert run_dsec("exec", "--user", "app", sid, "--", "id", "-u").stdout == "1000\n"
        p = run_dsec("exec", "--user", "root", sid, "--", "id", "-u", check=2)
        assert "fncall" in p.stderr and "1000:1000" in p.stderr
    finally:
        run_dsec("rm", sid)
    assert run_dsec("run", "--backend", "fncall", "--user", "nobody", "users@1", "--",
                    "id", "-u").stdout == "65534\n"


def test_sdk_user(node: dict[str, str], tmp_path: Path, busybox_tar: Path,
                  run_dsec) -> None:  # type: ignore[no-untyped-def]
    import dsec_cli.api.sandboxes as sandboxes

    _users(run_dsec, tmp_path, busybox_tar)
    with sandboxes.Sandbox("users@1", user="root") as sb:
        assert sb.exec("id -u").stdout == b"0\n"
        assert sb.exec("id -u", user="app").stdout == b"1000\n"
    assert sandboxes.run("users@1", ["id", "-un"]).stdout == b"app\n"
    assert sandboxes.run("users@1").stdout.startswith(b"uid=1000(app)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_entrypoint_and_cmd(node: dict[str, str], tmp_path: Path, busybox_tar: Path,
                            run_dsec, backend: str) -> None:  # type: ignore[no-untyped-def]
    _import(run_dsec, tmp_path, busybox_tar, "ep@1", [file("srv/x", b"x")],
            entrypoint=["/bin/echo", "from-entrypoint"], cmd=["default-arg"])
    b = ["--backend", backend]
    assert run_dsec("run", *b, "ep@1").stdout == "from-entrypoint default-arg\n"
    assert run_dsec("run", *b, "ep@1", "--", "given").stdout == "from-entrypoint given\n"
    # --entrypoint replaces the entrypoint and drops the image's cmd
    assert run_dsec("run", *b, "--entrypoint", "/bin/echo", "ep@1", "--", "only").stdout \
        == "only\n"
    assert run_dsec("run", *b, "--entrypoint", "/bin/pwd", "ep@1").stdout == "/\n"
    assert run_dsec("run", *b, "--entrypoint", "", "ep@1", "--", "echo", "bare").stdout \
        == "bare\n"


def test_image_without_entrypoint_or_cmd(node: dict[str, str], tmp_path: Path,
                                         busybox_tar: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    _import(run_dsec, tmp_path, busybox_tar, "bare@1", [file("srv/x", b"x")],
            entrypoint=[], cmd=[])
    assert run_dsec("run", "bare@1", "--", "echo", "hi").stdout == "hi\n"
    p = run_dsec("run", "bare@1", check=2)
    assert "no command" in p.stderr
    _no_sandboxes(run_dsec)


HOSTILE = [
    (b"root:x:0:0:root:/root:/bin/sh\napp:x:notanumber:1000::/home/app:/bin/sh\n",
     "/etc/passwd line 2 is malformed"),
    (b"root:x:0:0:root:/root:/bin/sh\napp:x:1000\n", "/etc/passwd line 2 is malformed"),
    (b"app:x:99999999999:1000::/home/app:/bin/sh\n", "/etc/passwd line 1 is malformed"),
    (b"app:x:1000:1000::/home/app:/bin/sh\n" + b"#" * (1 << 20), "more than the 1048576"),
    (b"\xff\xfe:x:0:0::/:/bin/sh\n", "/etc/passwd is not UTF-8"),
]


@pytest.mark.parametrize("passwd,message", HOSTILE)
def test_hostile_passwd_is_refused(node: dict[str, str], tmp_path: Path, busybox_tar: Path,
                                   run_dsec, passwd: bytes,
                                   message: str) -> None:  # type: ignore[no-untyped-def]
    _import(run_dsec, tmp_path, busybox_tar, "evil@1", [file("etc/passwd", passwd)],
            user="app", entrypoint=[], cmd=["id"])
    p = run_dsec("run", "--backend", "fncall", "evil@1", check=2)
    assert message in p.stderr
    _no_sandboxes(run_dsec)


def test_symlinked_passwd_is_not_followed(node: dict[str, str], tmp_path: Path,
                                          busybox_tar: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    _import(run_dsec, tmp_path, busybox_tar, "link@1",
            [symlink("etc/passwd", "/proc/1/environ")], user="app", entrypoint=[], cmd=["id"])
    p = run_dsec("run", "link@1", check=2)
    assert "symlink" in p.stderr and "/etc/passwd" in p.stderr
    _no_sandboxes(run_dsec)
    # numeric ids need no passwd entry: the symlink is still refused, never read through
    p = run_dsec("run", "--user", "1234", "link@1", check=2)
    assert "symlink" in p.stderr
