"""`dsec build DOCKERFILE --as NAME@VERSION`: real Dockerfiles built in real build sandboxes
(bubblewrap over overlayfs), then started with `dsec run` as `docker run` would start them.

The Debian base is a debootstrap minbase (made once per machine, from the Debian mirror, and
kept in /var/tmp); `apt-get install` inside RUN reaches the Debian mirror, `pip install`
PyPI, as they would under Docker."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from .. import debian
from ..conftest import build_store
from ..debian import base_specs, have_debian
from .conftest import store_snapshot

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="RUN needs root (overlayfs)")


def debian_tar() -> Path:
    if not have_debian():
        pytest.skip("debootstrap is not installed (scripts/setup.sh --dev)")
    return debian.debian_tar()


@pytest.fixture(scope="module")
def busybox_store(tmp_path_factory: pytest.TempPathFactory, busybox_tar: Path) -> str:
    work = tmp_path_factory.mktemp("bbstore")
    return build_store(base_specs(work / "specs", busybox_tar, "bb"), str(work / "store"),
                       work / "data")


@pytest.fixture(scope="module")
def debian_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    work = tmp_path_factory.mktemp("debstore")
    return build_store(base_specs(work / "specs", debian_tar(), "debian"),
                       str(work / "store"), work / "data")


@pytest.fixture
def deb_store(tmp_path: Path, debian_store: str) -> str:
    """A copy of the module's store holding `debian@1`, for one test to change."""
    dest = tmp_path / "store"
    shutil.copytree(debian_store, dest, symlinks=True)
    return str(dest)


@pytest.fixture
def store(tmp_path: Path, busybox_store: str) -> str:
    """A copy of the module's store holding `bb@1`, for one test to change."""
    dest = tmp_path / "store"
    shutil.copytree(busybox_store, dest, symlinks=True)
    return str(dest)


def dockerfile(ctx: Path, text: str, files: dict[str, str] | None = None) -> Path:
    ctx.mkdir(parents=True, exist_ok=True)
    for name, body in (files or {}).items():
        (ctx / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / name).write_text(body)
    (ctx / "Dockerfile").write_text(text)
    return ctx / "Dockerfile"


def build(run_dsec, store: str, path: Path, ref: str, *args: str, check: bool | int = True
          ) -> dict:
    p = run_dsec("build", str(path), "--as", ref, "--store", store, "--json", *args,
                 check=check)
    return json.loads(p.stdout) if p.returncode == 0 else {"stderr": p.stderr,
                                                           "code": p.returncode}


def run_in(run_dsec, store: str, ref: str, *cmd: str) -> str:
    args = ["--", *cmd] if cmd else []
    return run_dsec("run", ref, *args, env={"DSEC_STORE": store}).stdout


@pytest.mark.parametrize("text, line, words", [
    ("FROM bb@1\nHEALTHCHECK CMD true\n", 2, "HEALTHCHECK is not supported"),
    ("FROM bb@1\nRUN true\nONBUILD RUN true\n", 3, "ONBUILD is not supported"),
    ("FROM bb@1\nRUN --mount=type=cache,target=/x true\n", 2, "mounts (--mount)"),
    ("FROM bb@1\nCOPY --from=nowhere /a /b\n", 2, "--from=nowhere"),
    ("FROM bb@1\nCOPY --from=missing@9 /a /b\n", 2, "--from=missing@9: no such image"),
    ("FROM bb@1\nRUN echo x > /x\nRUN --network=bridge true\n", 3, "--network=bridge"),
    ("FROM bb@1\nCOPY --from=bad@@1 /a /b\n", 2, "--from=bad@@1"),
    ("FROM bb@1 AS a\nCOPY --from=b /a /b\nFROM bb@1 AS b\nCOPY --from=a /a /b\n", 2,
     "one before it"),
    ("FROM bb@1\nCMD [\"a\", 1]\n", 2, "JSON list of strings"),
    ("ENV A=1\nFROM bb@1\n", 1, "before the first FROM"),
    ("FROM bb@1\nFROB x\n", 2, "unknown instruction"),
    ("FROM missing@9\nRUN true\n", 1, "no such image"),
    ("FROM bb@1\nCOPY nothing-here /x\n", 2, "no such file"),
])
def test_bad_dockerfile_is_refused_by_line_and_changes_nothing(
        tmp_path: Path, run_dsec, store: str, text: str, line: int, words: str) -> None:
    path = dockerfile(tmp_path / "ctx", text)
    before = store_snapshot(Path(store))
    out = build(run_dsec, store, path, "bad@1", check=2)
    assert f"Dockerfile:{line}" in out["stderr"] and words in out["stderr"], out["stderr"]
    assert "Traceback" not in out["stderr"]
    assert store_snapshot(Path(store)) == before


@needs_root
def test_multi_stage_copy_user_env_workdir_entrypoint_and_cache(
        tmp_path: Path, run_dsec, deb_store: str) -> None:
    store = deb_store
    ctx = tmp_path / "ctx"
    path = dockerfile(ctx, """\
ARG BASE=debian@1
FROM $BASE AS build
RUN mkdir -p /out && echo built > /out/artifact && echo two > /out/second
FROM ${BASE}
ARG GREETING=hello
ENV APP_HOME=/srv/app MODE="a b"
RUN useradd -m -u 1001 app
WORKDIR $APP_HOME
COPY --chown=app:app src/ ./src/
COPY src/main.py .
COPY --from=build /out/artifact /out/second /opt/
ADD data.tar /data/
LABEL org.example.task=demo
USER app
RUN id -u > /home/app/uid && echo "$GREETING $MODE" > /home/app/greet && touch /home/app/mine
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["id -u; pwd; echo $APP_HOME"]
""", {"src/main.py": "print(1)\n", "src/skip.log": "no\n", ".dockerignore": "**/*.log\n"})
    import tarfile

    (tmp_path / "d").mkdir()
    (tmp_path / "d/inside.txt").write_text("from a tar\n")
    with tarfile.open(ctx / "data.tar", "w") as tf:
        tf.add(tmp_path / "d/inside.txt", arcname="inside.txt")

    first = build(run_dsec, store, path, "task@1")
    assert not any(i["cached"] for i in first["items"])
    image = first["items"][-1]
    assert image["ref"] == "task@1" and image["kind"] == "image"

    # `dsec run` without a command starts ENTRYPOINT + CMD as the image's user, in its workdir
    assert run_in(run_dsec, store, "task@1").split() == ["1001", "/srv/app", "/srv/app"]
    listing = run_in(run_dsec, store, "task@1",
                     "ls -ln /srv/app/src /home/app /opt; cat /home/app/greet /opt/artifact "
                     "/data/inside.txt; test -e /srv/app/src/skip.log || echo ignored; "
                     "echo $MODE; echo ${GREETING:-unset}")
    owned = {line.split()[-1]: line.split()[2:4] for line in listing.splitlines()
             if line.startswith("-")}
    assert owned["main.py"] == ["1001", "1001"]  # COPY --chown=app:app
    assert "main.py" in run_in(run_dsec, store, "task@1", "ls /srv/app")  # `COPY f .`
    assert owned["uid"] == owned["mine"] == ["1001", "1001"]  # written by RUN as USER app
    assert owned["artifact"] == ["0", "0"] and "second" in owned
    tail = listing.splitlines()[-6:]
    assert tail == ["hello a b", "built", "from a tar", "ignored", "a b", "unset"]
    doc = json.loads(run_dsec("inspect", "task@1", "--store", store, "--json").stdout)
    assert doc["env"]["APP_HOME"] == "/srv/app" and doc["workdir"] == "/srv/app"

    # the same Dockerfile again: every instruction cached, the same image
    again = build(run_dsec, store, path, "task@1")
    assert all(i["cached"] for i in again["items"] if i["kind"] == "layer")
    assert again["items"][-1]["manifest"] == image["manifest"]

    # a changed source rebuilds its COPY and what follows, nothing before it
    (ctx / "src/main.py").write_text("print(2)\n")
    third = build(run_dsec, store, path, "task@2")
    cached = [i["cached"] for i in third["items"] if i["kind"] == "layer"]
    # the build stage's RUN, useradd, WORKDIR cached; both COPYs of src/ and after rebuilt
    assert cached[:3] == [True, True, True] and not any(cached[3:])

    # a build arg reaches RUN and changes only the layers after it is used
    fourth = build(run_dsec, store, path, "task@3", "--build-arg", "GREETING=hi")
    assert "hi a b" in run_in(run_dsec, store, "task@3", "cat /home/app/greet")
    assert fourth["items"][-1]["manifest"] != third["items"][-1]["manifest"]

    # --target builds a stage; --squash makes one layer of its changes
    stage = build(run_dsec, store, path, "stage@1", "--target", "build", "--squash")
    layers = json.loads(run_dsec("inspect", "stage@1", "--store", store, "--json").stdout)
    assert len(layers["layers"]) == 2  # the base and one squashed layer
    assert [i["kind"] for i in stage["items"]] == ["layer", "image"]


@needs_root
def test_failing_run_names_the_line_and_writes_no_image(tmp_path: Path, run_dsec,
                                                       store: str) -> None:
    path = dockerfile(tmp_path / "ctx", "FROM bb@1\nRUN echo ok > /ok\nRUN exit 3\n")
    out = build(run_dsec, store, path, "fails@1", check=1)
    assert "Dockerfile:3" in out["stderr"] and "code 3" in out["stderr"]
    refs = Path(store) / "refs"
    assert not (refs / "fails").exists()


@needs_root
@pytest.mark.slow
def test_debian_apt_get_and_pip_install(tmp_path: Path, run_dsec, deb_store: str) -> None:
    """apt-get (which drops to its _apt user) and adduser's chowns need the build sandbox's
    full id map; pip reaches PyPI."""
    store = deb_store
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", ctx / "ca.crt")  # this host's CAs
    path = dockerfile(ctx, """\
FROM debian@1
ENV DEBIAN_FRONTEND=noninteractive PIP_CERT=/etc/host-ca.crt
COPY ca.crt /etc/host-ca.crt
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \\
      python3-venv adduser >/dev/null && rm -rf /var/lib/apt/lists/*
RUN adduser --disabled-password --gecos '' --uid 2000 dev \\
 && python3 -m venv /opt/venv && chown -R dev:dev /opt/venv
USER dev
RUN /opt/venv/bin/pip install -q --disable-pip-version-check six==1.16.0
WORKDIR /home/dev
CMD ["/opt/venv/bin/python", "-c", "import os,six;print(six.__version__,os.getuid(),os.getcwd())"]
""")
    built = build(run_dsec, store, path, "deb@1")
    assert built["items"][-1]["ref"] == "deb@1"
    assert run_in(run_dsec, store, "deb@1").split() == ["1.16.0", "2000", "/home/dev"]
    owners = run_in(run_dsec, store, "deb@1", "stat", "-c", "%u:%g %n",
                    "/opt/venv/bin/python3", "/home/dev",
                    "/var/cache/apt/archives/partial").split("\n")
    assert owners[0].startswith("2000:2000") and owners[1].startswith("2000:2000")
    assert owners[2].startswith(("42:", "100:"))  # _apt's id, as apt set it


@needs_root
def test_dockerfile_key_in_an_image_spec_builds_with_the_other_specs(
        tmp_path: Path, run_dsec, busybox_tar: Path) -> None:
    specs = tmp_path / "specs"
    base_specs(specs / "bb", busybox_tar, "bb")
    dockerfile(specs / "task", "FROM bb@1\nARG WHO=x\nRUN echo $WHO > /hi\nENV X=1\n"
               'CMD ["cat", "/hi"]\n')
    (specs / "task/task.yaml").write_text("image: task\nversion: '1'\n"
                                          "dockerfile: Dockerfile\nbuild_args: {WHO: me}\n")
    store = str(tmp_path / "store")
    out = json.loads(run_dsec("build", str(specs), "--store", store, "--json").stdout)
    assert out["items"][-1]["ref"] == "task@1"
    assert run_in(run_dsec, store, "task@1").strip() == "me"

    # a bad Dockerfile stops the whole build before anything is written
    (specs / "task/Dockerfile").write_text("FROM bb@1\nHEALTHCHECK CMD true\n")
    (specs / "bb/image.yaml").write_text((specs / "bb/image.yaml").read_text()
                                         .replace("version: '1'", "version: '2'"))
    before = store_snapshot(Path(store))
    bad = run_dsec("build", str(specs), "--store", store, check=2)
    assert "Dockerfile:2" in bad.stderr and "HEALTHCHECK" in bad.stderr
    assert store_snapshot(Path(store)) == before


@needs_root
def test_from_an_oci_image_imports_it_on_the_fly(tmp_path: Path, run_dsec, store: str
                                                 ) -> None:
    layout = tmp_path / "layout"
    run_dsec("export", "bb@1", "--store", store, "--format", "oci", str(layout))
    fresh = str(tmp_path / "fresh")  # a store that does not hold bb@1
    path = dockerfile(tmp_path / "ctx", f"FROM {layout}\nRUN echo on-top > /top\n"
                      'CMD ["cat", "/top"]\n')
    out = build(run_dsec, fresh, path, "oci-task@1")
    assert str(layout) in out["pinned"]
    assert run_in(run_dsec, fresh, "oci-task@1").strip() == "on-top"
    layers = json.loads(run_dsec("ls", "layers", "--store", fresh, "--json").stdout)
    assert any(i["ref"].startswith("oci-layer@") for i in layers)


@needs_root
def test_copy_from_an_image_of_the_store_or_an_oci_reference(tmp_path: Path, run_dsec,
                                                             store: str) -> None:
    """COPY --from names an image of the store (NAME@VERSION) or an OCI reference, imported
    on the fly as FROM imports one; its files keep their owners and modes."""
    path = dockerfile(tmp_path / "ctx", "FROM scratch\nCOPY --from=bb@1 /bin/ /bin/\n"
                      'CMD ["/bin/busybox", "echo", "copied"]\n')
    build(run_dsec, store, path, "copied@1")
    assert run_in(run_dsec, store, "copied@1").strip() == "copied"

    layout = tmp_path / "layout"
    run_dsec("export", "bb@1", "--store", store, "--format", "oci", str(layout))
    fresh = str(tmp_path / "fresh")  # a store that does not hold bb@1
    path = dockerfile(tmp_path / "ctx2", f"FROM {layout}\n"
                      f"COPY --from={layout} /bin/busybox /opt/busybox\n"
                      'CMD ["/opt/busybox", "echo", "from-oci"]\n')
    out = build(run_dsec, fresh, path, "oci-copy@1")
    assert str(layout) in out["pinned"]
    assert run_in(run_dsec, fresh, "oci-copy@1").strip() == "from-oci"
    again = build(run_dsec, fresh, path, "oci-copy@2")  # the same key: the layer is reused
    assert [i["cached"] for i in again["items"] if i["kind"] == "layer"] == [True]
