"""Park and thaw for the microvm and vm backends: the running guest saved to a state file
beside the sandbox's other state by QEMU migration, then QEMU gone (all its RAM back to the
host); thaw starts QEMU again from that file with the same writable disk and devices, so the
guest carries on where it stopped: same files, same processes (same pids), same hostname.

Files in the sandbox's state dir:

- ``park.state``: QEMU's migration stream of the stopped guest, complete (written as
  ``park.state.tmp``, fsynced, renamed). While it exists the sandbox is parked to it.
- ``park.json``: the QEMU command line the guest ran under (what thaw starts again, written
  before the state file is renamed into place).
- ``park.lock``: held (flock) by a park or thaw in progress; `recover` skips a sandbox whose
  lock is held, so a `dsec ps` beside a thaw never interferes with it.

Crash safety (what `recover`, run by node reconcile, relies on):

- park: stop + migrate into the temporary file, rename, then quit QEMU. Killed before the
  rename: QEMU still holds the stopped guest; the temporary file is removed and a thaw
  resumes that QEMU. Killed after: the file is complete; a QEMU left running is ended.
- thaw: QEMU starts with ``-S`` (the guest does not run after loading), the node row gets
  its new pid, the state file is removed, then the guest runs. Killed before the removal:
  the guest never ran, so its disk is as the file expects; the new QEMU is ended and the
  sandbox stays parked to the file. Killed after: the new QEMU holds the guest; thaw resumes
  it.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.errors import BackendError, SandboxError
from ...core.files import fsync_path
from .. import _cgroups, egress
from ..base import SandboxHandle
from . import vmsnap
from .qemu_qmp import QMPError, qmp

if TYPE_CHECKING:
    from .qemu import QemuBackend

STATE = "park.state"
ARGV = "park.json"
LOCK = "park.lock"


def state_file(handle: SandboxHandle) -> Path | None:
    sdir = handle.state.get("state_dir")
    return Path(sdir) / STATE if sdir else None


def saved(handle: SandboxHandle) -> bool:
    """True while the sandbox is parked to a complete state file."""
    f = state_file(handle)
    return f is not None and f.is_file()


@contextmanager
def _lock(handle: SandboxHandle, wait: bool = True) -> Iterator[bool]:
    sdir = Path(handle.state["state_dir"])
    fd = os.open(sdir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def rss(pid: int) -> int:
    """Resident bytes of a process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _argv_of(pid: int) -> list[str]:
    """The command line QEMU runs under, without a restore's ``-incoming`` (a sandbox made
    by snapshot boot was started from its template's stream)."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    argv = [a.decode() for a in raw]
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-incoming", "-S"):
            skip = a == "-incoming"
        else:
            out.append(a)
    return out


def park(b: QemuBackend, handle: SandboxHandle) -> dict[str, Any]:
    """Save the running guest to ``park.state`` and end its QEMU. Returns the figures:
    QEMU's resident bytes before, the state file's size. On failure the guest runs on."""
    st = handle.state
    sdir = Path(st["state_dir"])
    with _lock(handle):
        b._require_alive(handle)
        pid = int(st["pid"])
        argv = _argv_of(pid)
        before = rss(pid)
        tmp, final = sdir / (STATE + ".tmp"), sdir / STATE
        meta = sdir / ARGV
        meta_tmp = sdir / (ARGV + ".tmp")
        meta_tmp.write_text(json.dumps({"argv": argv}))
        fsync_path(meta_tmp)  # on disk before the state file it goes with
        os.replace(meta_tmp, meta)
        # the guest's agent port must not hold a connection when it is saved: after the
        # thaw the host end is a fresh socket (as for a snapshot boot's template)
        b._drop_client(handle.sandbox_id)
        time.sleep(0.5)
        t0 = time.monotonic()
        try:
            _save(st["qmp"], tmp, b.boot_timeout)
            _pause_for_tests("vm_park")
            fsync_path(tmp)
            os.rename(tmp, final)
            fsync_path(sdir)
        except BaseException:
            tmp.unlink(missing_ok=True)
            _done(tmp).unlink(missing_ok=True)
            try:
                qmp(st["qmp"], "cont")  # never left stopped by a park that failed
            except QMPError:
                pass
            raise
        saved_at = time.monotonic()
        _end_qemu(st, pid)
        size = final.stat().st_size
    return {"resident_before": before, "state_bytes": size,
            "save_seconds": round(saved_at - t0, 3)}


def _done(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".done")


def _save(qmp_path: str, tmp: Path, timeout: float) -> None:
    """Stop the guest and migrate it into ``tmp``; returns once the writer has written the
    whole stream (QEMU reports the migration complete when it has sent it down the pipe,
    which can be before ``cat`` has written its last bytes: the shell marks the end)."""
    done = _done(tmp)
    done.unlink(missing_ok=True)
    qmp(qmp_path, "stop")
    q = vmsnap._quote
    qmp(qmp_path, "migrate", {"uri": f"exec:cat > {q(tmp)} && : > {q(done)}"})
    deadline = time.monotonic() + timeout
    while True:
        info = qmp(qmp_path, "query-migrate") or {}
        status = info.get("status")
        if status == "completed" and done.exists():
            done.unlink()
            return
        if status in ("failed", "cancelled"):
            raise BackendError(f"saving the parked VM failed: {info.get('error-desc', status)}")
        if time.monotonic() > deadline:
            raise BackendError(f"saving the parked VM took over {timeout:.0f}s")
        time.sleep(0.05)


def _end_qemu(st: dict[str, Any], pid: int | None) -> None:
    from .qemu import _proc_start, quit_qemu

    if pid is None or _proc_start(pid) is None:
        return
    quit_qemu(st["qmp"], pid, 10.0)


def thaw(b: QemuBackend, handle: SandboxHandle, commit: Callable[[dict[str, Any]], None],
         cpu_class: str | None = None) -> dict[str, Any]:
    """Bring a parked guest back: from ``park.state`` into a new QEMU, or (after a crash
    between the save and QEMU's exit) the QEMU that still holds it stopped. ``commit`` is
    given the new handle state once QEMU holds the guest and before the state file is
    removed (the node writes it to its row). Returns the new handle state."""
    st = dict(handle.state)
    sdir = Path(st["state_dir"])
    final = sdir / STATE
    with _lock(handle):
        if not final.is_file():
            if not b.is_alive(handle):
                raise SandboxError(f"sandbox {handle.sandbox_id} has neither a QEMU nor a "
                                   "saved state", hint=f"remove it with `dsec rm "
                                                       f"{handle.sandbox_id}`")
            qmp(st["qmp"], "cont")
            return st
        argv = json.loads((sdir / ARGV).read_text())["argv"]
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            raise BackendError(f"{sdir / ARGV} is not a QEMU command line")
        new = SandboxHandle(handle.sandbox_id, handle.backend, st)
        Path(st["run_dir"]).mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in ("qmp", "agent_sock", "pidfile"):
            Path(st[name]).unlink(missing_ok=True)
        if st.get("network") == "allowlist":  # back into its namespace, behind its filter
            argv = [*egress.netns_argv(handle.sandbox_id), *argv]
        try:
            _start(st, argv + ["-S", "-incoming", f"exec:cat {vmsnap._quote(final)}"],
                   cpu_class)
            vmsnap.wait_loaded(st["qmp"], b.boot_timeout, lambda: b._is_our_qemu(new, st["pid"]),
                               ("paused", "postmigrate", "prelaunch"), "loading the parked VM")
            commit(st)  # the row knows the new QEMU before the file goes
            _pause_for_tests("vm_thaw")
        except BaseException:
            _end_qemu(st, st.get("pid"))
            raise
        final.unlink()
        fsync_path(sdir)
        (sdir / ARGV).unlink(missing_ok=True)
        qmp(st["qmp"], "cont")
        from .qemu import RESTORED_RETRY

        b._wait_ready(new, RESTORED_RETRY)  # the agent channel, attached again
    return st


def _pause_for_tests(point: str) -> None:
    from ...core.config import debug_delay

    pause = debug_delay(point)  # tests stop a park or thaw here and kill it
    if pause:
        time.sleep(pause)


def _start(st: dict[str, Any], argv: list[str], cpu_class: str | None) -> None:
    from .qemu import _proc_start

    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise BackendError(f"QEMU could not thaw the sandbox: {proc.stderr.strip()[-1000:]}")
    pid = int(Path(st["pidfile"]).read_text().strip())
    st["pid"], st["start_time"] = pid, _proc_start(pid)
    cg = _cgroups.Cgroup(st["cgroup"])
    kept = cg.exists()  # the group outlives the park, with its CPU class set
    cg.create()
    cg.add(pid)
    if cpu_class and not kept:
        cg.apply_class(cpu_class)
    elif cpu_class:
        Path(f"/proc/{pid}/oom_score_adj").write_text(str(_cgroups.OOM_SCORE_ADJ[cpu_class]))


def recover(b: QemuBackend, handle: SandboxHandle) -> str | None:
    """After a crash (node reconcile): no half-written state file, and no QEMU beside a
    complete one. Skips a sandbox whose park or thaw is running now. What was done, or
    None."""
    if not handle.state.get("state_dir") or not Path(handle.state["state_dir"]).is_dir():
        return None
    from .qemu import _find_qemu

    with _lock(handle, wait=False) as held:
        if not held:
            return None
        sdir = Path(handle.state["state_dir"])
        done = None
        for name in (STATE + ".tmp", STATE + ".tmp.done", ARGV + ".tmp"):
            if (sdir / name).exists():
                (sdir / name).unlink()
                done = "partial state removed"
        if (sdir / STATE).is_file():
            pid = _find_qemu(handle.sandbox_id)
            if pid is not None:
                _end_qemu({**handle.state}, pid)
                done = "QEMU beside a saved state ended"
        return done


def moved_state(b: QemuBackend, old: dict[str, Any], sid: str, sdir: Path, root: Path,
                cgroup: str) -> dict[str, Any]:
    """A parked guest whose files were moved into ``sdir`` on this node (run/migrate.py):
    its handle state and its saved command line pointed at this node's paths, with this
    node's QEMU, kernel and initramfs."""
    from ..sandbox_agent import agent_binary
    from .qemu import _default_state
    from .vmkernel import boot_image, build_initramfs

    argv = json.loads((sdir / ARGV).read_text()).get("argv")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise BackendError(f"{sdir / ARGV} is not a QEMU command line")
    old_dir, old_root = str(old.get("state_dir", "")), str(old.get("root_image", ""))
    if not old_dir or not old_root:
        raise BackendError("the moved sandbox's state names no state dir or root image")
    kernel = b._kernel()
    paths = {"-kernel": str(boot_image(kernel, b.vm_dir / "kernel")),
             "-initrd": str(build_initramfs(kernel, b.vm_dir / "initramfs",
                                            agent=agent_binary()))}
    out = [b._qemu_binary()]
    for prev, a in zip(argv, argv[1:], strict=False):
        if prev in paths:
            out.append(paths[prev])
        else:
            out.append(a.replace(old_root, str(root)).replace(old_dir + "/", f"{sdir}/"))
    (sdir / ARGV).write_text(json.dumps({"argv": out}))
    state = {**old, **_default_state(sid, str(sdir)), "cgroup": cgroup,
             "root_image": str(root)}
    state.pop("pid", None)
    state.pop("start_time", None)
    return state


def remove_files(sdir: Path) -> None:
    for name in (STATE, STATE + ".tmp", STATE + ".tmp.done", ARGV, ARGV + ".tmp", LOCK):
        (sdir / name).unlink(missing_ok=True)
