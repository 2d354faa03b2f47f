"""One lifecycle contract, run against every registered backend (`BACKENDS`: fncall,
container, microvm, vm): create, exec (exit code, stdout/stderr, env, cwd, stdin, timeout),
put/get file, snapshot diff, pause/resume, destroy leaving no process, mount or cgroup
behind, and the capabilities each declares on its class (`Backend.park_mechanism`,
`fork_mode`, `upper_on_host`...) agreeing with what it does.

A backend that lacks a feature declares it (`Backend.supports_pause`,
`Backend.supports_snapshot`); the suite then checks the declared behaviour (a UsageError
naming the backend, what a user sees) instead of skipping. One sandbox per backend is shared
by the module (VM boots under TCG cost seconds each); the VM backends (`Backend.is_vm`) are
marked slow."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec_cli.backends import (
    BACKENDS,
    Backend,
    BackendContext,
    ExecRequest,
    Limits,
    RootfsSpec,
    SandboxHandle,
    SandboxSpec,
    backend_class,
    get_backend,
)
from dsec_cli.backends._cgroups import Cgroup
from dsec_cli.backends.vm.vmkernel import default_kernel_dir
from dsec_cli.core.errors import UsageError

from ..backends.layers import busybox_layer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

#: every registered backend; a VM's boots are slow
NAMES = [pytest.param(n, marks=pytest.mark.slow) if backend_class(n).is_vm else n
         for n in BACKENDS]


@dataclass
class Box:
    backend: Backend
    handle: SandboxHandle
    state_dir: Path
    destroyed: bool = False

    def run(self, *argv: str, **kw: object):  # type: ignore[no-untyped-def]
        return self.backend.exec(self.handle, ExecRequest(list(argv), **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_layer(tmp_path_factory.mktemp("conformance-layer") / "tree")


@pytest.fixture(scope="module", params=NAMES)
def box(request: pytest.FixtureRequest, base_layer: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    name = request.param
    if backend_class(name).is_vm and not (default_kernel_dir() / "vmlinuz").exists() \
            and not os.environ.get("DSEC_KERNEL"):
        pytest.skip("no guest kernel: run scripts/setup.sh")
    node = tmp_path_factory.mktemp(f"conformance-{name}")
    ctx = BackendContext(node, f"dsec-conformance-{os.getpid()}", node / "runc")
    backend = get_backend(name, ctx)
    sid = f"c{name}{os.getpid()}"
    sdir = node / "sandboxes" / sid
    sdir.mkdir(parents=True)
    spec = SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec((base_layer,), sdir / "upper",
                                                         sdir / "work"),
                       state_dir=sdir, env={"GREETING": "hi"}, workdir="/root",
                       limits=Limits(memory=256 << 20, pids=64),
                       image_digest="sha256:" + "c" * 64)
    handle = backend.create(spec)
    b = Box(backend, handle, sdir)
    yield b
    if not b.destroyed:
        backend.destroy(handle)
    Cgroup(ctx.cgroup_parent).remove_if_empty()


def test_exec_exit_code_and_streams(box: Box) -> None:
    seen: list[tuple[str, bytes]] = []
    r = box.backend.exec(box.handle, ExecRequest(["sh", "-c", "echo out; echo err >&2; exit 7"]),
                         on_output=lambda kind, data: seen.append((kind, data)))
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (7, b"out\n", b"err\n", False)
    assert b"".join(d for k, d in seen if k == "stdout") == b"out\n"
    assert b"".join(d for k, d in seen if k == "stderr") == b"err\n"


def test_env_and_cwd(box: Box) -> None:
    script = 'echo "[$GREETING][$EXTRA]"; pwd'
    r = box.run("sh", "-c", script)
    assert r.stdout == b"[hi][]\n/root\n"  # the sandbox's env and workdir by default
    r = box.run("sh", "-c", script, env={"EXTRA": "there"}, cwd="/etc")
    assert r.stdout == b"[hi][there]\n/etc\n"


def test_stdin(box: Box) -> None:
    data = bytes(range(256)) * 64
    r = box.run("cat", stdin=data)
    assert (r.exit_code, r.stdout) == (0, data)


def test_timeout_kills_the_command(box: Box) -> None:
    r = box.run("sleep", "60", timeout=1.0)
    assert r.timed_out and r.exit_code != 0
    assert r.duration < 30
    assert box.run("true").exit_code == 0  # the sandbox is still usable


def test_put_and_get_file(box: Box) -> None:
    # /tmp: writable on every backend (fncall's view is read-only elsewhere)
    box.backend.put_file(box.handle, "/tmp/conf.bin", b"\x00payload\xff", 0o640)
    assert box.backend.get_file(box.handle, "/tmp/conf.bin") == b"\x00payload\xff"
    r = box.run("sh", "-c", "stat -c %a /tmp/conf.bin; cat /tmp/conf.bin")
    assert r.stdout == b"640\n\x00payload\xff"


def test_snapshot_diff_holds_the_changes(box: Box) -> None:
    if not box.backend.supports_snapshot:
        with pytest.raises(UsageError, match=box.backend.name):
            box.backend.snapshot_diff(box.handle)
        return
    assert box.run("sh", "-c", "echo new > /root/added; rm /etc/hello; sync").exit_code == 0
    upper = box.backend.snapshot_diff(box.handle)
    assert (upper / "root" / "added").read_bytes() == b"new\n"
    gone = (upper / "etc" / "hello").lstat()  # a whiteout: a 0:0 character device
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert not (upper / "data" / "keep" / "old").exists()  # untouched files stay out


@pytest.mark.parametrize("name", list(BACKENDS))
def test_declared_capabilities_hold_together(name: str) -> None:
    """What the node plans with, read from the class alone: each mechanism a backend
    declares is one it has."""
    kind = backend_class(name)
    assert kind.name == name
    assert kind.park_mechanism in ("freezer", "state-file")
    if kind.park_mechanism == "freezer":
        assert kind.supports_pause  # parked by freezing
    else:  # saved to a file and back: the backend's own park and thaw
        assert kind.park is not Backend.park and kind.thaw is not Backend.thaw
    assert kind.fork_mode in ("snapshot", "tmp")
    if kind.fork_mode == "snapshot":
        assert kind.supports_snapshot  # the diff becomes the copies' shared layer
    assert not (kind.upper_on_host and kind.is_vm)  # a guest's upper dir is in its disk
    assert isinstance(kind.member_estimate, int) and kind.member_estimate > 0


def test_upper_on_host_shows_the_writes(box: Box) -> None:
    """A backend that declares its upper dir on the host writes there (a job's state digest
    reads it); one that does not, never does."""
    box.run("sh", "-c", "echo up > /root/on-host; sync")  # fails where / is read-only
    seen = (box.state_dir / "upper" / "root" / "on-host").is_file()
    assert seen is box.backend.upper_on_host


def test_pause_and_resume(box: Box) -> None:
    if not box.backend.supports_pause:
        with pytest.raises(UsageError, match=box.backend.name):
            box.backend.pause(box.handle)
        return
    box.backend.pause(box.handle)
    try:
        assert box.backend.is_alive(box.handle)  # frozen, not gone
    finally:
        box.backend.resume(box.handle)
    assert box.run("echo", "back").stdout == b"back\n"


def _processes_mentioning(text: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if text.encode() in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except OSError:
            continue  # exited meanwhile
    return out


def test_destroy_leaves_nothing(box: Box) -> None:
    """Runs last for each backend: it destroys the shared sandbox."""
    state = box.handle.state
    cgroup = state.get("cgroup")
    box.backend.destroy(box.handle)
    box.destroyed = True
    assert not box.backend.is_alive(box.handle)
    assert _processes_mentioning(str(box.state_dir)) == []
    pid = state.get("pid")
    if not box.backend.is_vm:  # kept on the host: both must be known
        assert pid and cgroup, state
    if pid:
        assert not Path(f"/proc/{pid}").exists() or \
            str(box.state_dir).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(box.state_dir) not in mounts
    if cgroup:
        assert [d for d in Cgroup(cgroup).all_dirs() if d.exists()] == []
    box.backend.destroy(box.handle)  # destroying again is harmless
