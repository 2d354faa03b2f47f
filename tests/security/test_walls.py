"""The walls around a sandbox, probed from inside as hostile code would, on real runc and
bubblewrap: cgroupfs and sysctls read-only in every network mode, setuid files and device
nodes a sandbox makes inert on the host, state dirs closed to other host users, a bounded
writable disk, and the seccomp policy.

Every probe is harmless where its wall is missing: it reads mount flags and permissions,
opens its own cgroup's files for writing without writing, runs a setuid copy of a program
that only prints its uid, and calls denied system calls with arguments that change nothing
outside the probing process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.api.sandboxes import Sandbox
from tests.run.conftest import (  # noqa: F401  (fixtures)
    IMAGE,
    dsec,
    dsec_home,
    leaks,
    node_env,
    sandbox_data,
    store_url,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

BACKENDS = ["container", "fncall"]
NETWORKS = ["none", "host"]
PROBE_SRC = Path(__file__).with_name("wallprobe.c")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture(scope="session")
def probe(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """wallprobe.c built static, so it runs in any image (never run on the host itself)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (scripts/setup.sh installs it)")
    out = tmp_path_factory.mktemp("probe") / "wallprobe"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(PROBE_SRC)], check=True)
    return out.read_bytes()


@pytest.fixture(params=[(b, n) for b in BACKENDS for n in NETWORKS],
                ids=[f"{b}-{n}" for b in BACKENDS for n in NETWORKS])
def sb(request: pytest.FixtureRequest, node_env: dict[str, str]) -> Iterator[Sandbox]:  # noqa: F811
    backend, network = request.param
    with Sandbox.create(IMAGE, backend=backend, network=network, memory="64M", pids=32) as s:
        yield s


def _mounts(sb: Sandbox, with_root: bool = False) -> dict[str, str]:
    """Mount point → options of the mount seen there (the last one mounted over it); with
    `with_root`, the options are prefixed by the mount's root inside its filesystem."""
    r = sb.exec(["cat", "/proc/self/mountinfo"])
    assert r.exit_code == 0, r.stderr
    out: dict[str, str] = {}
    for line in r.stdout.decode().splitlines():
        f = line.split()
        out[f[4]] = f"{f[3]} {f[5]}" if with_root else f[5]
    return out


# -- 1. cgroupfs and sysctls --------------------------------------------------------------------
def test_sys_and_sysctls_are_read_only(sb: Sandbox) -> None:
    mounts = _mounts(sb)
    under_sys = {mp: o for mp, o in mounts.items() if mp == "/sys" or mp.startswith("/sys/")}
    writable = {mp: o for mp, o in under_sys.items() if "ro" not in o.split(",")}
    assert writable == {}
    # /proc/sys: a sandbox's root is uid 0, which the kernel lets write most sysctls
    assert "ro" in mounts.get("/proc/sys", "").split(","), mounts
    # every other mount below /proc is read-only too, except masks (binds of /dev/null)
    rooted = _mounts(sb, with_root=True)
    under_proc = {mp: v for mp, v in rooted.items() if mp.startswith("/proc/")}
    assert {"/proc/sys"} <= set(under_proc)
    writable = {mp: v for mp, v in under_proc.items()
                if "ro" not in v.split()[1].split(",") and not v.split()[0].endswith("/null")}
    assert writable == {}
    # opening for writing (without writing) is refused by the read-only mount
    r = sb.exec(["sh", "-c", "exec 3>>/proc/sys/kernel/core_pattern && echo OPENED"])
    assert r.exit_code != 0 and b"OPENED" not in r.stdout
    assert b"Read-only file system" in r.stderr


def test_own_cgroup_limits_cannot_be_written(sb: Sandbox) -> None:
    """The sandbox's own pids and memory limit files, opened for appending and never written."""
    script = ("p=$(grep -E '^[0-9]+:pids:' /proc/self/cgroup | cut -d: -f3); "
              "m=$(grep -E '^[0-9]+:memory:' /proc/self/cgroup | cut -d: -f3); "
              "u=$(grep -E '^0::' /proc/self/cgroup | cut -d: -f3); "
              "for f in /sys/fs/cgroup/pids$p/pids.max "
              "/sys/fs/cgroup/memory$m/memory.limit_in_bytes "
              "/sys/fs/cgroup/unified$u/cgroup.procs; do "
              "  if [ -e $f ]; then "
              "    (exec 3>>$f) 2>/dev/null && echo WRITABLE $f || echo REFUSED $f; "
              "  else echo ABSENT $f; fi; "
              "done")
    r = sb.exec(["sh", "-c", script])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 3 and not [ln for ln in lines if ln.startswith("WRITABLE")], lines
    if sb.backend == "fncall":  # no sysfs at all inside bubblewrap sandboxes
        assert all(ln.startswith("ABSENT") for ln in lines), lines
    else:  # the probe found real limit files (at least pids.max and the memory limit)
        assert sum(ln.startswith("REFUSED") for ln in lines) >= 2, lines


# -- 2. state dirs and setuid/device files ------------------------------------------------------
def _writable_dir(sb: Sandbox) -> tuple[str, Path]:
    """A directory the sandbox writes that lives on the host: the container's upper dir (its
    root). fncall has none (see test_fncall_writes_nothing_to_host_disk)."""
    return "/", Path(sb.node.lookup(sb.id).handle["upper"])


def test_fncall_writes_nothing_to_host_disk(node_env: dict[str, str]) -> None:  # noqa: F811
    """fncall's root is a read-only overlay; every writable mount inside is memory-backed
    (tmpfs /tmp, sized by --disk), so nothing it makes lands on a host filesystem."""
    with Sandbox.create(IMAGE, backend="fncall") as sb:
        r = sb.exec(["cat", "/proc/self/mountinfo"])
        assert r.exit_code == 0, r.stderr
        writable = []
        for line in r.stdout.decode().splitlines():
            pre, _, post = line.partition(" - ")
            fields, (fstype, _src, super_opts) = pre.split(), post.split()[:3]
            if "rw" not in fields[5].split(",") or fstype in ("tmpfs", "proc", "devpts",
                                                                "mqueue"):
                continue
            if fstype == "overlay" and "upperdir=" not in super_opts:
                continue  # an overlay of lower dirs only cannot be written
            if fstype == "devtmpfs" and (fields[4].startswith("/dev/") or fields[3] == "/null"):
                continue  # binds of /dev/null, /dev/zero... (and masks): device files, no data
            writable.append((fields[4], fstype))
        assert writable == [], writable


def _mount_of(path: Path) -> str:
    best, opts = "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mp = fields[4]
            if (str(path) + "/").startswith(mp.rstrip("/") + "/") and len(mp) >= len(best):
                best, opts = mp, fields[5]
    return opts


def test_setuid_file_made_inside_is_inert_on_host(probe: bytes,
                                                  node_env: dict[str, str]) -> None:  # noqa: F811
    with Sandbox.create(IMAGE, backend="container") as sb:
        inside, host_dir = _writable_dir(sb)
        sb.write_file(inside + "suid-probe", probe, mode=0o755)
        r = sb.exec(["sh", "-c", f"chmod 4755 {inside}suid-probe && stat -c %a {inside}suid-probe"])
        assert r.exit_code == 0 and r.stdout == b"4755\n", r
        target = host_dir / "suid-probe"
        assert target.stat().st_mode & 0o4000 and target.stat().st_uid == 0
        # (a) no other host user may even reach the sandbox's state
        state = Path(node_env["DSEC_STATE_DIR"])
        for d in (state, state / "sandboxes", state / "sandboxes" / sb.id):
            p = subprocess.run([*NOBODY, "stat", str(d / ".")], capture_output=True)
            assert p.returncode != 0 and b"Permission denied" in p.stderr, d
            assert d.stat().st_mode & 0o077 == 0, oct(d.stat().st_mode)
        # (b) the dir's host mount ignores setuid bits and device nodes
        opts = _mount_of(target).split(",")
        assert "nosuid" in opts and "nodev" in opts, opts
        # (c) handed the file itself (an fd, past the closed dirs), nobody cannot become root
        # with it: the mount refuses to exec it (noexec), or would ignore its setuid bit
        fd = os.open(target, os.O_RDONLY)
        try:
            p = subprocess.run([*NOBODY, f"/proc/self/fd/{fd}", "euid"], pass_fds=(fd,),
                               capture_output=True)
        finally:
            os.close(fd)
        assert p.stdout != b"0\n"
        assert (p.returncode == 126 and b"Permission denied" in p.stderr) or \
            (p.returncode, p.stdout) == (0, b"65534\n"), p


def test_device_node_made_inside_is_inert_on_host(node_env: dict[str, str]) -> None:  # noqa: F811
    with Sandbox.create(IMAGE, backend="container") as sb:
        r = sb.exec(["mknod", "/null-copy", "c", "1", "3"])  # what /dev/null is
        assert r.exit_code == 0, r.stderr
        node_file = Path(sb.node.lookup(sb.id).handle["upper"]) / "null-copy"
        with pytest.raises(PermissionError):
            os.open(node_file, os.O_WRONLY)  # nodev: the host refuses to open it as a device


# -- 3. --disk ----------------------------------------------------------------------------------
def _loops_under(path: str) -> list[str]:
    out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True)
    devs = json.loads(out.stdout or '{"loopdevices": []}')["loopdevices"]
    return [d["name"] for d in devs if (d.get("back-file") or "").startswith(path)]


def test_disk_limit_container(node_env: dict[str, str]) -> None:  # noqa: F811
    state = node_env["DSEC_STATE_DIR"]
    with Sandbox.create(IMAGE, backend="container", disk="32M") as sb:
        r = sb.exec(["sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=64; echo rc=$?; sync"])
        assert b"No space left on device" in r.stderr and b"rc=1" in r.stdout, r
        size = int(sb.exec(["stat", "-c", "%s", "/fill"]).stdout)
        assert 16 << 20 < size <= 32 << 20
        # the bytes live in the sandbox's own image, not loose in the host's state dir
        sdir = Path(state) / "sandboxes" / sb.id
        assert (sdir / "disk.img").stat().st_size == 32 << 20
        assert len(_loops_under(state)) == 1
        opts = _mount_of(Path(sb.node.lookup(sb.id).handle["upper"])).split(",")
        assert {"nosuid", "nodev"} <= set(opts)
        # a write past the limit cost nothing outside: the sandbox still works
        assert sb.exec(["sh", "-c", "rm /fill && echo ok > /after"]).exit_code == 0
    assert _loops_under(state) == [] and leaks(state)["mounts"] == []


def test_disk_limit_fncall_tmp(node_env: dict[str, str]) -> None:  # noqa: F811
    with Sandbox.create(IMAGE, backend="fncall", disk="16M") as sb:
        r = sb.exec(["sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=64; echo rc=$?"])
        assert b"No space left on device" in r.stderr and b"rc=1" in r.stdout, r


def test_disk_loop_device_freed_after_kill_and_reconcile(node_env: dict[str, str]) -> None:  # noqa: F811
    """kill -9 of a process creating --disk sandboxes, then reconcile and rm: no loop device,
    image or mount is left."""
    state = node_env["DSEC_STATE_DIR"]
    code = ("import sys; from dsec_cli.api.sandboxes import Sandbox\n"
            "for i in range(50): Sandbox.create(sys.argv[1], disk='16M'); print(i, flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code, IMAGE], stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline() == b"0\n"  # one create done, the next in flight
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    from dsec_cli.run.node import Node

    n = Node(state)
    n.sandboxes()  # reconcile: the aborted create is torn down
    for r in n.db.all():
        n.remove(r.id)
    deadline = time.monotonic() + 60  # the kernel frees an autoclear loop device shortly after
    while _loops_under(state) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _loops_under(state) == []
    assert leaks(state) == {"mounts": [], "cgroups": [], "dirs": []}


def test_disk_bad_size_is_a_usage_error(node_env: dict[str, str]) -> None:  # noqa: F811
    p = dsec(node_env, "run", IMAGE, "--disk", "1M", "--", "true", check=2)
    assert b"--disk" in p.stderr and b"Traceback" not in p.stderr
    p = dsec(node_env, "run", IMAGE, "--disk", "lots", "--", "true", check=2)
    assert b"Traceback" not in p.stderr


# -- 4. seccomp ---------------------------------------------------------------------------------
DENIED_CALLS = ["keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                "name_to_handle_at", "open_by_handle_at", "mount", "fsopen", "open_tree",
                "setns", "unshare_user", "unshare_mount", "personality_no_aslr",
                "clone_newuser"]


def _probe_results(out: bytes) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in out.decode().splitlines())


def _check_probe(res: dict[str, str]) -> None:
    eperm = str(1)
    assert {k: res.get(k) for k in DENIED_CALLS} == dict.fromkeys(DENIED_CALLS, eperm), res
    assert res["clone3"] == "38"  # ENOSYS: libc falls back to clone
    assert res["clone_plain"] == "0" and res["personality_linux"] == "0"  # normal work runs
    assert res["x32"] == "killed" and res["i386"] == "killed"  # other ABIs: other numbers


def test_seccomp_denies_in_sandboxes(sb: Sandbox, probe: bytes) -> None:
    sb.write_file("/tmp/wallprobe", probe, mode=0o755)
    r = sb.exec(["/tmp/wallprobe", "syscalls"])
    assert r.exit_code == 0, r.stderr
    _check_probe(_probe_results(r.stdout))
    r = sb.exec(["sh", "-c", "unshare -U true; echo u=$?; unshare -m true; echo m=$?; "
                 "grep Seccomp: /proc/self/status; ls / >/dev/null && echo ls-ok"])
    assert b"u=1" in r.stdout and b"m=1" in r.stdout and b"ls-ok" in r.stdout, r
    assert b"Seccomp:\t2" in r.stdout


def test_seccomp_in_build_steps(probe: bytes, tmp_path: Path) -> None:
    from dsec_cli.backends.oneshot import run_in_root

    root = tmp_path / "root"
    root.mkdir()
    (root / "wallprobe").write_bytes(probe)
    (root / "wallprobe").chmod(0o755)
    lines: list[str] = []
    assert run_in_root(root, ["/wallprobe", "syscalls"], env={}, on_line=lines.append) == 0
    _check_probe(_probe_results("\n".join(lines).encode()))


def test_seccomp_in_function_pool(probe: bytes) -> None:
    from dsec_cli.backends.fnpool import FunctionPool

    code = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            "rc = libc.syscall(250, 0, -1, 0); print(rc, ctypes.get_errno())")
    with FunctionPool(1, cgroup_parent=None) as pool:
        r = pool.run([sys.executable, "-c", code])
    assert r.exit_code == 0 and r.stdout.split() == [b"-1", b"1"], r  # keyctl: EPERM


def test_sealed_dirs_are_removed_through_a_symlinked_state_dir(
        node_env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    """The seal is a mount: rm must find it in mountinfo (resolved paths) even when the state
    dir is named through a symlink, or the dir and its mount would stay behind."""
    from dsec_cli.run.node import CreateOptions, Node

    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    n = Node(link, node_env["DSEC_STORE"])
    rec = n.create(IMAGE, CreateOptions(backend="fncall"))  # runc refuses symlinked roots
    assert any(str(m).startswith(str(real)) for m in leaks(str(real))["mounts"])
    n.remove(rec.id)
    assert leaks(str(real)) == {"mounts": [], "cgroups": [], "dirs": []}
