"""What the README and docs/sandboxes.md promise of a sandbox, checked as a user meets it:
`run`'s --env, --workdir, --cpus and --timeout; id prefixes; the container backend's hardening
(capabilities, no new privileges, seccomp, masked /proc paths, denied devices); the README's
SDK example as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IMAGE, REPO, dsec, leaks

#: the capabilities a container sandbox keeps (Docker's default set), as bit numbers; written
#: out here, not read from the backend, so a capability added there fails this test
KEPT_CAPS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
             "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13,
             "SYS_CHROOT": 18, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31}


def test_run_env_workdir_cpus(node_env: dict[str, str]) -> None:
    quota = ("cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || "
             "cut -d' ' -f1 /sys/fs/cgroup/cpu.max")
    p = dsec(node_env, "run", "--env", "A=1", "-e", "B=two words", "--workdir", "/etc",
             "--cpus", "0.5", IMAGE, "--", "sh", "-c", f'echo "$A|$B"; pwd; {quota}')
    assert p.stdout == b"1|two words\n/etc\n50000\n", p
    p = dsec(node_env, "run", "-w", "/tmp", IMAGE, "--", "pwd")
    assert p.stdout == b"/tmp\n"
    assert json.loads(dsec(node_env, "ps", "--json").stdout) == []


def test_run_timeout_kills_the_command_and_removes_the_sandbox(node_env: dict[str, str]) -> None:
    # the command would sleep 10 minutes; the bound of the dsec call is generous
    p = dsec(node_env, "run", "--timeout", "1", IMAGE, "--", "sleep", "600", check=137,
             timeout=120)
    assert b"timed out" in p.stderr or b"timeout" in p.stderr, p.stderr
    assert json.loads(dsec(node_env, "ps", "--json").stdout) == []
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_id_prefixes(node_env: dict[str, str]) -> None:
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    try:
        assert len(sid) >= 8
        p = dsec(node_env, "exec", sid[:6], "--", "echo", "by prefix")
        assert p.stdout == b"by prefix\n"
        other = "0" if sid[0] != "0" else "1"  # a prefix no sandbox has
        p = dsec(node_env, "exec", other + sid[1:6], "--", "true", check=2)
        assert (other + sid[1:6]).encode() in p.stderr, p.stderr
        assert dsec(node_env, "rm", sid[:6]).stdout.decode().strip() == sid
    finally:
        dsec(node_env, "rm", sid, check=None)
    assert json.loads(dsec(node_env, "ps", "--json").stdout) == []


def _status(node_env: dict[str, str], sid: str) -> dict[str, str]:
    out = dsec(node_env, "exec", sid, "--", "cat", "/proc/self/status").stdout.decode()
    return dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)


def test_container_hardening(node_env: dict[str, str]) -> None:
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    try:
        st = _status(node_env, sid)
        kept = sum(1 << b for b in KEPT_CAPS.values())
        for field in ("CapEff", "CapPrm", "CapBnd"):
            assert int(st[field], 16) == kept, (field, st[field], hex(kept))
        assert int(st["CapAmb"], 16) == 0 and int(st["CapInh"], 16) == 0
        assert st["NoNewPrivs"].strip() == "1"
        assert st["Seccomp"].strip() == "2"  # a filter is installed
        # without CAP_SYS_ADMIN and under seccomp: no mount, whatever the uid
        p = dsec(node_env, "exec", sid, "--", "mount", "-t", "tmpfs", "t", "/mnt", check=None)
        assert p.returncode != 0 and b"denied" in p.stderr.lower() or \
            b"not permitted" in p.stderr, p
        # masked /proc paths read as empty (bound over by /dev/null or an empty tmpfs)
        p = dsec(node_env, "exec", sid, "--", "sh", "-c",
                 "wc -c < /proc/keys; wc -c < /proc/timer_list; ls -A /proc/acpi | wc -l")
        assert p.stdout.split() == [b"0", b"0", b"0"], p
        assert Path("/proc/keys").read_bytes() != b""  # the host's is not empty
        # /dev holds the standard nodes only; a node made with CAP_MKNOD cannot be opened
        # (the device cgroup denies every device but those)
        p = dsec(node_env, "exec", sid, "--", "sh", "-c", "ls /dev")
        assert set(p.stdout.split()) == {b"fd", b"full", b"null", b"ptmx", b"pts", b"random",
                                         b"shm", b"stderr", b"stdin", b"stdout", b"tty",
                                         b"urandom", b"zero"}, p.stdout
        disk = os.stat("/proc/self/exe").st_dev  # the host's root disk: a real block device
        major, minor = os.major(disk), os.minor(disk)
        p = dsec(node_env, "exec", sid, "--", "sh", "-c",
                 f"mknod /tmp/blk b {major} {minor} && mknod /tmp/mem c 1 1 && echo made; "
                 "head -c1 /tmp/blk; head -c1 /tmp/mem; true")
        assert p.stdout == b"made\n", p
        assert p.stderr.count(b"Operation not permitted") == 2, p.stderr
    finally:
        dsec(node_env, "rm", sid, check=None)


def test_readme_sdk_example_as_written(tmp_path: Path) -> None:
    """The README's Python example, unchanged, against a fresh store and node."""
    text = (REPO / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "dsec.Sandbox(" in code and "build_specs" in code
    env = {**os.environ, "DSEC_STORE": (tmp_path / "store").as_uri(),
           "DSEC_STATE_DIR": str(tmp_path / "state"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "0 b'/srv/www\\n'\n", p
    assert leaks(str(tmp_path / "state")) == {"mounts": [], "cgroups": [], "dirs": []}


def test_sandbox_pin_keeps_its_image_through_rmi_and_gc(node_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    """A running sandbox's pin keeps its image's objects in the store when its refs are
    removed and gc runs with no grace; once the sandbox is removed, gc deletes them."""
    from dsec_cli.build.builder import build
    from dsec_cli.format.closure import closure
    from dsec_cli.format.refs import get_ref
    from dsec_cli.push.stores import open_store

    url = node_env["DSEC_STORE"]
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "only-here").write_bytes(os.urandom(4096))
    (tmp_path / "pinlayer.yaml").write_text(
        'layer: pinlayer\nversion: "1"\nsteps:\n  - copy: {src: ./files, dst: /pinned}\n')
    (tmp_path / "pinned.yaml").write_text(
        f'image: pinned\nversion: "1"\nlayers: [{IMAGE}, pinlayer@1]\n')
    build([tmp_path / "pinlayer.yaml", tmp_path / "pinned.yaml"], url)
    with open_store(url) as st:
        layer = get_ref(st, "pinlayer@1")
        keys = set(closure(st, layer.manifest)) | set(closure(st, get_ref(st, "pinned@1").manifest))
        keys -= set(closure(st, get_ref(st, IMAGE).manifest))  # shared with the base image
    assert keys
    sid = dsec(node_env, "run", "-d", "pinned@1").stdout.decode().strip()
    try:
        dsec(node_env, "rmi", "pinned@1", "pinlayer@1")
        out = json.loads(dsec(node_env, "gc", "--grace", "0", "--json").stdout)["store"]
        assert out["pins"] >= 1 and not set(out["deleted"]) & keys, out
        with open_store(url) as st:
            assert all(st.has(k) for k in keys)
        p = dsec(node_env, "exec", sid, "--", "wc", "-c", "/pinned/only-here")
        assert p.stdout.split()[0] == b"4096"
    finally:
        dsec(node_env, "rm", sid)
    out = json.loads(dsec(node_env, "gc", "--grace", "0", "--json").stdout)["store"]
    assert keys <= set(out["deleted"]), out
    with open_store(url) as st:
        assert not [k for k in keys if st.has(k)]
        assert get_ref(st, IMAGE) is not None  # the base image is untouched


@pytest.mark.slow
def test_vm_backends_through_the_cli_and_snapshot_of_a_vm(node_env: dict[str, str]) -> None:
    """README: `dsec run --backend microvm|vm`; docs/vm.md: a VM sandbox's snapshot, taken
    through the node, runs anywhere (here in a container)."""
    from dsec_cli.backends.vm.vmkernel import default_kernel_dir

    assert (default_kernel_dir() / "vmlinuz").exists() or os.environ.get("DSEC_KERNEL"), \
        "no guest kernel: scripts/setup.sh installs it"
    p = dsec(node_env, "run", "--backend", "microvm", IMAGE, "--", "sh", "-c",
             "cat /etc/motd; uname -r", timeout=600)
    motd, kernel = p.stdout.decode().split("\n")[:2]
    assert motd == "Welcome to a dsec sandbox." and kernel != os.uname().release, p
    sid = dsec(node_env, "run", "-d", "--backend", "vm", IMAGE, timeout=600).stdout.decode().strip()
    try:
        dsec(node_env, "exec", sid, "--", "sh", "-c", "echo from-the-vm > /root/vm.txt",
             timeout=300)
        doc = json.loads(dsec(node_env, "snapshot", sid, "--as", "vmsnap@1", "--json",
                              timeout=600).stdout)
        assert doc["image"] == "vmsnap@1"
    finally:
        dsec(node_env, "rm", sid, timeout=300)
    p = dsec(node_env, "run", "vmsnap@1", "--", "cat", "/root/vm.txt")
    assert p.stdout == b"from-the-vm\n"
    assert json.loads(dsec(node_env, "ps", "--json").stdout) == []
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}
