"""The microvm and vm backends against real QEMU guests (TCG here; KVM where it works).

One sandbox per backend is booted per module and shared by the tests; a second microvm
is started by a separate process that is then killed with SIGKILL, to show a sandbox
outlives dsec and is found, used and destroyed again through its saved handle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.backends import (
    ExecRequest,
    Limits,
    RootfsSpec,
    SandboxHandle,
    SandboxSpec,
    get_backend,
)
from dsec_cli.backends.vm.qemu import QemuBackend
from dsec_cli.core.errors import NotFoundError, UsageError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("guest_kernel", "as_root")]

MEM = 384 << 20
PIDS = 40


def spec_for(sid: str, layers: tuple[Path, ...], state: Path, digest: str, **kw: object
             ) -> SandboxSpec:
    sdir = state / "sandboxes" / sid
    return SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec(layers, sdir / "upper", sdir / "work"),
                       state_dir=sdir, env={"GREETING": "hi"}, workdir="/root",
                       limits=Limits(cpus=2, memory=MEM, pids=PIDS), image_digest=digest,
                       **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["microvm", "vm"])
def vm(request: pytest.FixtureRequest, base_layer: Path, node_dir: Path
       ) -> Iterator[tuple[QemuBackend, SandboxHandle]]:
    name = request.param
    backend = get_backend(name, state_dir=node_dir)
    assert isinstance(backend, QemuBackend)
    sid = f"t{name}{os.getpid()}"
    handle = backend.create(spec_for(sid, (base_layer,), node_dir, "sha256:" + "a" * 64))
    yield backend, handle
    backend.destroy(handle)


def run(vm: tuple[QemuBackend, SandboxHandle], *argv: str, **kw: object):  # type: ignore[no-untyped-def]
    backend, handle = vm
    return backend.exec(handle, ExecRequest(list(argv), **kw))  # type: ignore[arg-type]


def test_exec_output_exit_code_env_cwd(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    chunks: list[tuple[str, bytes]] = []
    backend, handle = vm
    r = backend.exec(handle, ExecRequest(["sh", "-c", "echo out; echo err >&2; exit 7"]),
                     on_output=lambda s, b: chunks.append((s, b)))
    assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    assert ("stdout", b"out\n") in chunks
    r = run(vm, "sh", "-c", "echo $GREETING $EXTRA; pwd; cat", env={"EXTRA": "there"},
            stdin=b"from stdin")
    assert r.stdout == b"hi there\n/root\nfrom stdin"
    assert run(vm, "pwd", cwd="/etc").stdout == b"/etc\n"
    assert run(vm, "no-such-command").exit_code == 127


def test_describe_reports_acceleration(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    backend, handle = vm
    d = backend.describe(handle)
    assert d["accel"] in ("kvm", "tcg") and d["pid"] == handle.state["pid"]
    assert d["machine"] in ("microvm", "q35") and d["paused"] is False
    assert backend.is_alive(handle)


def test_limits_visible_inside(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    assert run(vm, "nproc").stdout == b"2\n"
    meminfo = run(vm, "cat", "/proc/meminfo").stdout.decode()
    total_kib = int(meminfo.split("MemTotal:")[1].split()[0])
    assert MEM // 1024 * 0.6 < total_kib <= MEM // 1024  # the kernel keeps some for itself


def test_pids_limit_stops_forks(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    r = run(vm, "sh", "-c", f"for i in $(seq {PIDS + 10}); do sleep 1 & done; wait")
    assert b"can't fork" in r.stderr or b"Resource temporarily unavailable" in r.stderr
    assert run(vm, "true").exit_code == 0  # the limit frees up once they exit


def test_network_is_off(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    assert run(vm, "ls", "/sys/class/net").stdout.split() == [b"lo"]


def test_put_and_get_file(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    backend, handle = vm
    data = os.urandom(3 << 20)
    backend.put_file(handle, "/root/blob", data, 0o600)
    assert backend.get_file(handle, "/root/blob") == data
    assert run(vm, "stat", "-c", "%a %s", "/root/blob").stdout == f"600 {len(data)}\n".encode()
    with pytest.raises(NotFoundError):
        backend.get_file(handle, "/no/such/file")


def test_timeout_kills_hanging_command(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    r = run(vm, "sleep", "600", timeout=2)
    assert r.timed_out and r.exit_code == 137
    assert run(vm, "echo", "still", "serving").stdout == b"still serving\n"


def test_pause_and_resume(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    backend, handle = vm
    backend.pause(handle)
    assert backend.is_paused(handle) and backend.describe(handle)["paused"] is True
    backend.resume(handle)
    assert not backend.is_paused(handle)
    assert run(vm, "echo", "resumed").stdout == b"resumed\n"


def test_snapshot_diff_is_overlay_upper(vm: tuple[QemuBackend, SandboxHandle]) -> None:
    backend, handle = vm
    assert run(vm, "sh", "-c", "echo new > /root/new && rm /etc/hello && "
                               "rm -r /data/keep && mkdir /data/keep && echo n > /data/keep/f"
               ).exit_code == 0
    diff = backend.snapshot_diff(handle)
    assert (diff / "root" / "new").read_text() == "new\n"
    st = os.lstat(diff / "etc" / "hello")
    assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0  # whiteout
    assert os.getxattr(diff / "data" / "keep", "trusted.overlay.opaque") == b"y"
    assert not (diff / "data" / "keep" / "old").exists()
    assert run(vm, "cat", "/root/new").stdout == b"new\n"  # the guest runs on


CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from dsec_cli.backends import get_backend
    sys.path.insert(0, {tests!r})
    from test_qemu import spec_for
    layers = tuple(Path(p) for p in {layers!r})
    b = get_backend("microvm", state_dir={node!r})
    h = b.create(spec_for({sid!r}, layers, Path({node!r}), "sha256:" + "b" * 64,
                          network="host"))
    print(json.dumps(h.state), flush=True)
    time.sleep(3600)
""")


def test_snapshot_as_layer_and_survival_of_kill9(base_layer: Path, node_dir: Path,
                                                 tmp_path: Path) -> None:
    """A diff taken from one VM, stacked as a layer under a new VM (with the `host` network)
    created by a process that is then SIGKILLed: the VM outlives it, serves exec, and
    destroy leaves nothing."""
    backend = get_backend("microvm", state_dir=node_dir)
    first = backend.create(spec_for(f"s{os.getpid()}", (base_layer,), node_dir, ""))
    try:
        backend.exec(first, ExecRequest(["sh", "-c", "echo layered > /etc/added; rm /etc/hello"]))
        diff = backend.snapshot_diff(first)
    finally:
        backend.destroy(first)

    sid = f"k{os.getpid()}"
    code = CHILD.format(tests=str(Path(__file__).parent), layers=[str(base_layer), str(diff)],
                        node=str(node_dir), sid=sid)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    state = json.loads(line)
    handle = SandboxHandle(sid, "microvm", state)
    fresh = get_backend("microvm", state_dir=node_dir)
    try:
        assert fresh.is_alive(handle)
        r = fresh.exec(handle, ExecRequest(["sh", "-c", "cat /etc/added; ls /etc"]))
        assert r.stdout == b"layered\n" + b"added\n"
        # network="host": a user-mode NIC configured by the guest init
        r = fresh.exec(handle, ExecRequest(["ip", "-4", "addr", "show", "eth0"]))
        assert b"10.0.2.15/24" in r.stdout
    finally:
        # as after a crash before the handle was saved: only the id and state dir are known
        fresh.destroy(SandboxHandle(sid, "microvm", {"state_dir": state["state_dir"]}))
    pid = state["pid"]
    assert not fresh.is_alive(handle)
    assert not Path(f"/proc/{pid}").exists() or b"dsec-" not in Path(
        f"/proc/{pid}/cmdline").read_bytes()
    mounts = Path("/proc/mounts").read_text()
    assert state["snap_mount"] not in mounts and str(node_dir) not in mounts
    assert not Path(state["disk"]).exists() and not Path(state["run_dir"]).exists()
    fresh.destroy(handle)  # idempotent on a destroyed sandbox


def test_bad_input_is_a_usage_error(base_layer: Path, node_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown backend"):
        get_backend("firecracker")
    missing = get_backend("microvm", state_dir=node_dir, kernel=str(tmp_path / "no-kernel"))
    spec = spec_for("bad1", (base_layer,), tmp_path, "")
    with pytest.raises(UsageError, match="no-kernel"):
        missing.create(spec)
    assert not spec.state_dir.exists()  # nothing was created
    ok = get_backend("vm", state_dir=node_dir)
    with pytest.raises(UsageError, match="memory"):
        ok.create(dataclasses.replace(spec, limits=Limits(memory=1 << 20)))
    with pytest.raises(UsageError, match="does not exist"):
        ok.create(spec_for("bad3", (tmp_path / "nope",), tmp_path, ""))
    with pytest.raises(UsageError, match="accelerator"):
        get_backend("vm", state_dir=node_dir, accel="hvf")
    assert not list(tmp_path.glob("sandboxes/*"))


def test_destroy_ends_a_qemu_no_record_holds(node_dir: Path) -> None:
    """A create killed while QEMU daemonized can leave QEMU's daemon child, whose pid no
    handle or pidfile holds (the pid recorded or found was its parent's, now gone): destroy
    ends whatever still carries the sandbox's QEMU name. A process with that name in its
    argv stands where the daemon child would."""
    from dsec_cli.backends.vm.qemuproc import find_qemu, qemu_name

    backend = get_backend("microvm", state_dir=node_dir)
    sid = f"orphan{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "-name",
                              qemu_name(sid).decode()])
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        backend.destroy(SandboxHandle(sid, "microvm", {"pid": gone.pid}))
        assert child.wait(timeout=60) == -signal.SIGKILL
        assert find_qemu(sid) is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
