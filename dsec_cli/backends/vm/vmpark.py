"""Park and thaw for the microvm and vm backends: the running guest saved to a state file
beside the sandbox's other state by QEMU migration, then QEMU gone (all its RAM back to the
host); thaw starts QEMU again from that file with the same writable disk and devices, so the
guest carries on where it stopped: same files, same processes (same pids), same hostname.

Files in the sandbox's state dir:

- ``park.state``: QEMU's migration stream of the stopped guest, complete (written as
  ``park.state.tmp``, fsynced, renamed). While it exists the sandbox is parked to it.
- ``park.lock``: held (flock) by a park or thaw in progress; `recover` skips a sandbox whose
  lock is held, so a `dsec ps` beside a thaw never interferes with it.

No command line is saved: thaw builds QEMU's from the sandbox's handle state with the code
that built it at create (`QemuBackend.parked_argv`), here and on a node the guest moved to
(`moved_state`), so a state file is only ever data QEMU loads, never options it is given.

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
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ...core.config import debug_delay
from ...core.errors import BackendError, SandboxError, UsageError
from ...core.files import fsync_path
from .. import _cgroups, egress
from ..base import Limits, SandboxHandle
from . import vmsnap
from .qemu_qmp import QMPError, qmp
from .qemuagent import RESTORED_RETRY
from .qemuargv import guest_shape
from .qemuproc import default_state, find_qemu, make_run_dir, proc_start, quit_qemu


class QemuGuests(Protocol):
    """What park and thaw use of a backend (`qemu.QemuBackend`)."""

    boot_timeout: float

    @property
    def name(self) -> str: ...
    def is_alive(self, handle: SandboxHandle) -> bool: ...
    def acceleration(self) -> dict[str, str]: ...
    def parked_argv(self, sid: str, st: dict[str, Any]) -> list[str]: ...
    def _require_alive(self, handle: SandboxHandle) -> None: ...
    def _is_our_qemu(self, handle: SandboxHandle, pid: int) -> bool: ...
    def _drop_client(self, sid: str) -> None: ...
    def _wait_ready(self, handle: SandboxHandle, retry: float) -> None: ...

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


def park(b: QemuGuests, handle: SandboxHandle) -> dict[str, Any]:
    """Save the running guest to ``park.state`` and end its QEMU. Returns the figures:
    QEMU's resident bytes before, the state file's size. On failure the guest runs on."""
    st = handle.state
    sdir = Path(st["state_dir"])
    with _lock(handle):
        b._require_alive(handle)
        pid = int(st["pid"])
        before = rss(pid)
        tmp, final = sdir / (STATE + ".tmp"), sdir / STATE
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
    if pid is None or proc_start(pid) is None:
        return
    quit_qemu(st["qmp"], pid, 10.0)


def thaw(b: QemuGuests, handle: SandboxHandle, commit: Callable[[dict[str, Any]], None],
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
        # the run dir is this node's, wherever an older handle had it
        st.update(default_state(handle.sandbox_id, None))
        run = make_run_dir(st)
        for name in ("qmp", "agent_sock", "pidfile"):
            (run / os.path.basename(st[name])).unlink(missing_ok=True)
        argv = b.parked_argv(handle.sandbox_id, st)
        new = SandboxHandle(handle.sandbox_id, handle.backend, st)
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
        (sdir / ARGV).unlink(missing_ok=True)  # left by an older dsec's park
        qmp(st["qmp"], "cont")
        b._wait_ready(new, RESTORED_RETRY)  # the agent channel, attached again
    return st


def _pause_for_tests(point: str) -> None:
    pause = debug_delay(point)  # tests stop a park or thaw here and kill it
    if pause:
        time.sleep(pause)


def _start(st: dict[str, Any], argv: list[str], cpu_class: str | None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise BackendError(f"QEMU could not thaw the sandbox: {proc.stderr.strip()[-1000:]}")
    pid = int(Path(st["pidfile"]).read_text().strip())
    st["pid"], st["start_time"] = pid, proc_start(pid)
    cg = _cgroups.Cgroup(st["cgroup"])
    kept = cg.exists()  # the group outlives the park, with its CPU class set
    cg.create()
    cg.add(pid)
    if cpu_class and not kept:
        cg.apply_class(cpu_class)
    elif cpu_class:
        Path(f"/proc/{pid}/oom_score_adj").write_text(str(_cgroups.OOM_SCORE_ADJ[cpu_class]))


def recover(b: QemuGuests, handle: SandboxHandle) -> str | None:
    """After a crash (node reconcile): no half-written state file, and no QEMU beside a
    complete one. Skips a sandbox whose park or thaw is running now. What was done, or
    None."""
    if not handle.state.get("state_dir") or not Path(handle.state["state_dir"]).is_dir():
        return None
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
            pid = find_qemu(handle.sandbox_id)
            if pid is not None:
                _end_qemu({**handle.state}, pid)
                done = "QEMU beside a saved state ended"
        return done


#: the handle keys a moved parked guest may bring (see `moved_state`)
MOVED_KEYS = frozenset({"run_dir", "pidfile", "qmp", "agent_sock", "state_dir", "console",
                        "disk", "snap_mount", "machine", "env", "workdir", "network",
                        "cgroup", "accel", "root_image", "pid", "start_time", "restored",
                        "guest", "user"})
#: bounds on the guest environment a moved sandbox brings
MOVED_ENV_VARS = 4096
MOVED_TEXT = 64 << 10


def moved_state(b: QemuGuests, old: dict[str, Any], sid: str, sdir: Path, root: Path,
                cgroup: str, limits: Limits) -> dict[str, Any]:
    """The handle state of a parked guest whose files were moved into ``sdir`` on this node
    (run/migrate.py). Every path, the accelerator and the guest's shape are this node's own
    (``limits`` are the moved record's, checked as a create's options are); of what the
    source node sent only plain data is kept, checked: the guest's environment, working
    dir and user, and whether it was restored from a saved boot (which devices it has)."""
    what = f"the moved sandbox {sid}'s handle"
    unknown = sorted(str(k) for k in old if k not in MOVED_KEYS)
    if unknown:
        raise UsageError(f"{what} has unknown keys: {', '.join(unknown)[:200]}")
    if old.get("machine") != b.name:
        raise UsageError(f"{what} is of a {str(old.get('machine'))[:40]!r} guest, not "
                         f"{b.name}")
    network = old.get("network", "none")
    if network not in ("none", "host"):
        raise UsageError(f"{what}: network {str(network)[:40]!r} cannot move (none or host)")
    state: dict[str, Any] = {
        **default_state(sid, str(sdir)), "machine": b.name, "cgroup": cgroup,
        "root_image": str(root), "network": network, "accel": b.acceleration()["accel"],
        "env": check_moved_env(old.get("env", {}), what),
        "workdir": _moved_workdir(old.get("workdir", "/"), what),
        "guest": guest_shape(limits)}
    restored = old.get("restored")
    if restored:
        if not isinstance(restored, str | bool):
            raise UsageError(f"{what}: restored must be a template key")
        state["restored"] = True
    user = old.get("user")
    if user is not None:
        state["user"] = _moved_user(user, what)
    return state


def check_moved_env(env: Any, what: str) -> dict[str, str]:
    """A moved sandbox's environment: names to strings, bounded in count and length."""
    if not isinstance(env, dict) or len(env) > MOVED_ENV_VARS or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= MOVED_TEXT
            and len(v) <= MOVED_TEXT and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        raise UsageError(f"{what}: env must map at most {MOVED_ENV_VARS} names to strings "
                         f"(each under {MOVED_TEXT} characters, no NUL)")
    return dict(env)


def _moved_workdir(workdir: Any, what: str) -> str:
    if not isinstance(workdir, str) or not workdir.startswith("/") or \
            len(workdir) > 4096 or "\0" in workdir:
        raise UsageError(f"{what}: workdir {str(workdir)[:60]!r} is not an absolute path")
    return workdir


def _moved_user(user: Any, what: str) -> dict[str, Any]:
    def uid(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32

    groups = user.get("groups") if isinstance(user, dict) else None
    if not (isinstance(user, dict) and set(user) == {"uid", "gid", "groups"}
            and uid(user["uid"]) and uid(user["gid"]) and isinstance(groups, list)
            and len(groups) <= 1024 and all(uid(g) for g in groups)):
        raise UsageError(f"{what}: user must be {{uid, gid, groups}} of numeric ids")
    return {"uid": user["uid"], "gid": user["gid"], "groups": list(groups)}


def remove_files(sdir: Path) -> None:
    for name in (STATE, STATE + ".tmp", STATE + ".tmp.done", ARGV, ARGV + ".tmp", LOCK):
        (sdir / name).unlink(missing_ok=True)
