"""Cgroups for sandboxes on whatever hierarchy the node mounts: v2 unified, v1 per controller,
or the v1/v2 hybrid of many hosts (controllers on v1, an empty unified tree beside them).

A `Cgroup` names one relative path (for example ``dsec-1a2b3c4d/<sandbox id>``) and resolves it
in every hierarchy that holds a controller dsec uses. runc creates the same paths for
containers; fncall sandboxes create them here. Either way dsec reads counters, freezes and
removes through this one class.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..core.errors import BackendError

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu", "freezer", "cpuacct")

#: CPU classes (docs/density.md): (cpu.shares on v1, cpu.weight on v2, cpu.idle).
#: ``latency`` outweighs a default group tenfold, so its wake-ups preempt batch work;
#: ``idle`` runs only when nothing else wants the CPU (SCHED_IDLE for the group where the
#: kernel has cpu.idle, the smallest weight otherwise).
CPU_CLASSES: dict[str, tuple[int, int, int]] = {
    "latency": (10240, 1000, 0),
    "batch": (1024, 100, 0),
    "idle": (2, 1, 1),
}
#: per class, the /proc/PID/oom_score_adj of the sandbox's processes as it starts (its
#: agent); the agent starts commands 300 above itself. Host-wide OOM only: each sandbox's
#: own limit is its own. Only raised, never lowered below the default: raising needs no
#: CAP_SYS_RESOURCE, which a dsec inside a container may lack.
OOM_SCORE_ADJ: dict[str, int] = {"latency": 0, "batch": 300, "idle": 600}
#: per class, how its processes are scheduled within their group, inherited by what they
#: fork: (policy, slice in ns). The cgroup weights decide shares over time; these decide
#: who runs first on a wake-up. A ``latency`` process asks EEVDF for a 0.1 ms slice (kernel
#: 6.12+: a shorter slice gives an earlier deadline, so its wake-up preempts a spinning batch
#: task at once instead of at the next tick); ``batch`` processes are SCHED_BATCH, whose
#: wake-ups never preempt. Kernels without custom slices keep the default slice.
SCHED_NORMAL, SCHED_BATCH = 0, 3
SCHED_CLASSES: dict[str, tuple[int, int]] = {
    "latency": (SCHED_NORMAL, 100_000),
    "batch": (SCHED_BATCH, 0),
    "idle": (SCHED_NORMAL, 0),
}
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(os.uname().machine)


#: struct sched_attr, SCHED_ATTR_SIZE_VER0: size, policy, flags, nice, priority, runtime,
#: deadline, period
_SCHED_ATTR = struct.Struct("IIQiIQQQ")


@cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def set_sched(pid: int, policy: int, slice_ns: int) -> bool:
    """sched_setattr(2) on one process: its policy and, where the kernel takes one, its EEVDF
    slice (``sched_runtime`` of a SCHED_NORMAL/BATCH task; 0 for the default). False where
    the process is gone or the kernel refuses (an older kernel clamps or ignores the slice;
    one without sched_setattr leaves the defaults)."""
    if _SCHED_SETATTR is None:
        return False
    import ctypes

    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, policy, 0, 0, 0,
                                                        slice_ns, 0, 0))
    if _libc().syscall(_SCHED_SETATTR, pid, attr, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.ESRCH, errno.ENOSYS):
        log.debug("sched_setattr(%d) refused: %s", pid, os.strerror(err))
    return False


@cache
def custom_slices() -> bool:
    """Whether this kernel takes an EEVDF slice per task (6.12+): its sched_getattr(2)
    reports a fair task's slice as ``sched_runtime``, where older kernels report 0."""
    if _SCHED_SETATTR is None:
        return False
    import ctypes

    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    # sched_getattr's number follows sched_setattr's
    if _libc().syscall(_SCHED_SETATTR + 1, 0, buf, _SCHED_ATTR.size, 0) != 0:
        return False
    return _SCHED_ATTR.unpack(buf.raw)[5] > 0


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    mounts: dict[str, Path]  # controller -> hierarchy root (v2: all the same)
    roots: tuple[Path, ...] = ()  # every cgroup hierarchy mounted (runc makes groups in all)


@cache
def layout() -> Layout:
    """Probe what is mounted (read once per process)."""
    if (ROOT / "cgroup.controllers").is_file():
        return Layout(2, {c: ROOT for c in CONTROLLERS}, (ROOT,))
    mounts: dict[str, Path] = {}
    roots: list[Path] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = right.split()
            if not fields or fields[0] not in ("cgroup", "cgroup2"):
                continue
            mountpoint = Path(left.split()[4])
            if mountpoint not in roots:
                roots.append(mountpoint)
            if fields[0] == "cgroup2":
                continue
            for opt in fields[2].split(","):
                if opt in CONTROLLERS and opt not in mounts:
                    mounts[opt] = mountpoint
    return Layout(1, mounts, tuple(roots))


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroup:
    def __init__(self, rel: str) -> None:
        self.rel = rel.strip("/")
        self.layout = layout()

    def dirs(self) -> dict[str, Path]:
        return {c: m / self.rel for c, m in self.layout.mounts.items()}

    def all_dirs(self) -> list[Path]:
        return [r / self.rel for r in self.layout.roots]

    def path(self, controller: str) -> Path | None:
        m = self.layout.mounts.get(controller)
        return None if m is None else m / self.rel

    def is_v2(self, controller: str) -> bool:
        """Whether `controller` sits on the unified (v2) hierarchy: decided per controller,
        as a hybrid host may mount some on v1 and leave others to v2."""
        m = self.layout.mounts.get(controller)
        return m is not None and _on_v2(m)

    # -- creation ------------------------------------------------------------------------------
    def create(self, memory: int | None = None, pids: int | None = None,
               cpus: float | None = None) -> None:
        """Make the group in every hierarchy and set its limits (the caller joins it)."""
        try:
            if self.layout.version == 2:
                self._enable_v2_controllers()
            for d in set(self.dirs().values()):
                d.mkdir(parents=True, exist_ok=True)
            self._limit(memory, pids, cpus)
        except OSError as e:
            self.remove()
            raise BackendError(f"cannot set up cgroup {self.rel}: {e}") from e

    def _enable_v2_controllers(self) -> None:
        parent = ROOT
        for part in Path(self.rel).parts[:-1]:
            _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
            parent = parent / part
            parent.mkdir(exist_ok=True)
        _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")

    def _limit(self, memory: int | None, pids: int | None, cpus: float | None) -> None:
        v2 = self.layout.version == 2
        mem, pid, cpu = self.path("memory"), self.path("pids"), self.path("cpu")
        if memory and mem:
            if v2:
                _write(mem / "memory.max", str(memory))
                _write(mem / "memory.swap.max", "0")
            else:
                _write(mem / "memory.limit_in_bytes", str(memory))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    _write(mem / "memory.memsw.limit_in_bytes", str(memory))
        if pids and pid:
            _write(pid / "pids.max", str(pids))
        if cpus and cpu:
            quota = max(1000, int(cpus * 100000))
            if v2:
                _write(cpu / "cpu.max", f"{quota} 100000")
            else:
                _write(cpu / "cpu.cfs_period_us", "100000")
                _write(cpu / "cpu.cfs_quota_us", str(quota))

    def set_cpu_class(self, cls: str) -> dict[str, int]:
        """Apply a CPU class (`CPU_CLASSES`) with the controls the cpu controller offers
        here; returns the values written, by file name (empty without a cpu controller)."""
        shares, weight, idle = CPU_CLASSES[cls]
        cpu = self.path("cpu")
        if cpu is None or not cpu.is_dir():
            return {}
        out = {"cpu.weight": weight} if self.is_v2("cpu") else {"cpu.shares": shares}
        if (cpu / "cpu.idle").exists():
            out["cpu.idle"] = idle
        try:
            if out.get("cpu.idle") == 0:  # leave SCHED_IDLE first: weights are ignored in it
                _write(cpu / "cpu.idle", "0")
            for name, value in out.items():
                _write(cpu / name, str(value))
        except OSError as e:
            raise BackendError(f"cannot set CPU class {cls} on {self.rel}: {e}") from e
        return out

    def apply_class(self, cls: str) -> dict[str, int]:
        """A sandbox's class: its CPU controls, and its processes' standing with the host's
        OOM killer (`OOM_SCORE_ADJ`, inherited by everything they fork later), so a batch
        sandbox overrunning a full host is killed before a latency one."""
        out = self.set_cpu_class(cls)
        adj = OOM_SCORE_ADJ[cls]
        policy, slice_ns = SCHED_CLASSES[cls]
        scheduled = False
        for pid in self.procs():
            try:
                _write(Path(f"/proc/{pid}/oom_score_adj"), str(adj))
            except (ProcessLookupError, FileNotFoundError):
                pass  # a process that just exited
            except OSError as e:
                log.warning("cannot set the OOM standing of %s: %s", self.rel, e)
            scheduled = set_sched(pid, policy, slice_ns) or scheduled
        out["oom_score_adj"] = adj
        if scheduled:
            out["sched_policy"], out["sched_slice_ns"] = policy, slice_ns
        return out

    def cpu_class_files(self) -> dict[str, int]:
        """The CPU controls as the kernel holds them (for reports and tests)."""
        out: dict[str, int] = {}
        cpu = self.path("cpu")
        for name in ("cpu.shares", "cpu.weight", "cpu.idle"):
            try:
                out[name] = int((cpu / name).read_text()) if cpu else 0
            except (OSError, ValueError):
                out.pop(name, None)
        return out

    def cpu_seconds(self) -> float | None:
        """CPU time the group has used (cpuacct on v1, cpu.stat on v2)."""
        try:
            acct = self.path("cpuacct")
            if acct is not None and not self.is_v2("cpuacct"):
                return int((acct / "cpuacct.usage").read_text()) / 1e9
            cpu = self.path("cpu")
            if cpu is not None and self.is_v2("cpu"):
                for line in (cpu / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return None

    # -- memory reclamation --------------------------------------------------------------------
    def memory_use(self) -> dict[str, int]:
        """``resident`` (bytes charged to the group in RAM: anonymous, shmem and page cache),
        ``anon`` and ``swapped`` (bytes the group holds in swap)."""
        mem = self.path("memory")
        if mem is None:
            return {}
        try:
            stat: dict[str, int] = {}
            for line in (mem / "memory.stat").read_text().splitlines():
                k, _, v = line.partition(" ")
                if v.isdigit():
                    stat[k] = int(v)
            if self.is_v2("memory"):
                resident = int((mem / "memory.current").read_text())
                swap_file = mem / "memory.swap.current"
                swapped = int(swap_file.read_text()) if swap_file.exists() else 0
                anon = stat.get("anon", 0) + stat.get("shmem", 0)
            else:
                resident = int((mem / "memory.usage_in_bytes").read_text())
                swapped = stat.get("total_swap", stat.get("swap", 0))
                anon = stat.get("total_rss", stat.get("rss", 0)) + \
                    stat.get("total_shmem", stat.get("shmem", 0))
        except (OSError, ValueError):
            return {}
        return {"resident": resident, "anon": anon, "swapped": swapped}

    def reclaim(self) -> int:
        """Push the group's memory out (page cache dropped, anonymous memory to swap where
        there is swap): memory.reclaim on v2, memory.force_empty on v1 (which reclaims with
        tasks inside), lowering and restoring the limit where neither is offered. Returns the
        bytes the group's resident use went down by."""
        mem = self.path("memory")
        if mem is None or not mem.is_dir():
            return 0
        before = self.memory_use().get("resident", 0)
        try:
            if self.is_v2("memory") and (mem / "memory.reclaim").exists():
                try:
                    _write(mem / "memory.reclaim", str(max(before, 4096)))
                except OSError as e:
                    if e.errno != errno.EAGAIN:  # EAGAIN: less than asked could go
                        raise
            else:
                # force_empty loops while it makes progress, and a lowered limit would
                # OOM-kill whatever allocates meanwhile: the group stays frozen throughout
                with self._frozen_for_reclaim():
                    if not self.is_v2("memory") and (mem / "memory.force_empty").exists():
                        _write(mem / "memory.force_empty", "0")
                    else:
                        self._squeeze(mem)
        except OSError as e:
            raise BackendError(f"cannot reclaim memory of {self.rel}: {e}") from e
        return max(0, before - self.memory_use().get("resident", before))

    @contextmanager
    def _frozen_for_reclaim(self) -> Iterator[None]:
        """Frozen while the body runs, then as it was (a paused group stays frozen)."""
        f = self.path("freezer")
        if f is None or not f.is_dir() or self.frozen():
            yield
            return
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    def _squeeze(self, mem: Path) -> None:
        """Reclaim by lowering the limit step by step (the kernel reclaims to meet it, and
        refuses with EBUSY where it cannot), then restore it."""
        name = "memory.max" if self.is_v2("memory") else "memory.limit_in_bytes"
        old = (mem / name).read_text().strip()
        target = self.memory_use().get("resident", 0)
        try:
            while target > (1 << 20):
                target //= 2
                try:
                    _write(mem / name, str(target))
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    break
        finally:
            _write(mem / name, old)

    def add(self, pid: int) -> None:
        for d in set(self.dirs().values()):
            _write(d / "cgroup.procs", str(pid))

    # -- state ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        return any(d.is_dir() for d in self.all_dirs())

    def procs(self) -> list[int]:
        out: set[int] = set()
        for d in set(self.dirs().values()):
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(out)

    def freeze(self) -> None:
        self._freezer(True)

    def thaw(self) -> None:
        self._freezer(False)

    def frozen(self) -> bool:
        f = self.path("freezer")
        try:
            if self.layout.version == 2 and f:
                return (f / "cgroup.freeze").read_text().strip() == "1"
            return f is not None and (f / "freezer.state").read_text().strip() != "THAWED"
        except OSError:
            return False

    def _freezer(self, freeze: bool) -> None:
        f = self.path("freezer")
        if f is None:
            raise BackendError("no freezer cgroup is mounted on this node: cannot pause")
        try:
            if self.layout.version == 2:
                _write(f / "cgroup.freeze", "1" if freeze else "0")
                return
            want = "FROZEN" if freeze else "THAWED"
            _write(f / "freezer.state", want)
            for _ in range(2000):  # v1 freezing is asynchronous: wait until it settles
                if (f / "freezer.state").read_text().strip() == want:
                    return
                time.sleep(0.001)
                _write(f / "freezer.state", want)
        except OSError as e:
            raise BackendError(f"cannot {'freeze' if freeze else 'thaw'} {self.rel}: {e}") from e
        raise BackendError(f"cgroup {self.rel} did not settle {'frozen' if freeze else 'thawed'}")

    def limit_events(self) -> tuple[int, int]:
        """(OOM kills, pids-limit hits) so far: two small reads, for the exec path."""
        oom = hits = 0
        mem, pid = self.path("memory"), self.path("pids")
        try:
            if mem:
                name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
                for line in (mem / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        oom = int(line.split()[1])
            if pid:
                hits = int((pid / "pids.events").read_text().split()[-1])
        except (OSError, ValueError, IndexError):
            pass
        return oom, hits

    def counters(self) -> dict[str, int]:
        """Memory use, OOM kills and pids, for reporting limits that were hit."""
        out: dict[str, int] = {}
        mem, pid = self.path("memory"), self.path("pids")
        try:
            if mem:
                if self.layout.version == 2:
                    out["memory"] = int((mem / "memory.current").read_text())
                    ev = (mem / "memory.events").read_text()
                else:
                    out["memory"] = int((mem / "memory.usage_in_bytes").read_text())
                    ev = (mem / "memory.oom_control").read_text()
                for line in ev.splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        out["oom_kills"] = int(v)
            if pid:
                out["pids"] = int((pid / "pids.current").read_text())
                ev_path = pid / "pids.events"
                if ev_path.exists():
                    out["pids_max_hits"] = int(ev_path.read_text().split()[-1])
        except (OSError, ValueError):
            pass
        return out

    # -- removal -------------------------------------------------------------------------------
    def kill_all(self) -> None:
        if self.frozen():
            # a frozen task cannot act on SIGKILL (v1): thaw first, after queueing the kill
            for p in self.procs():
                _kill(p)
            self.thaw()
        for p in self.procs():
            _kill(p)

    def remove(self, timeout: float = 10.0) -> None:
        """Kill what is left inside and remove the group from every hierarchy."""
        deadline = time.monotonic() + timeout
        dirs = self.all_dirs()
        while True:
            busy = [_rmtree_cgroup(d) for d in dirs]  # every hierarchy, no short-circuit
            if not any(busy):
                return
            self.kill_all()
            if time.monotonic() > deadline:
                raise BackendError(f"cgroup {self.rel} still has processes after SIGKILL")
            time.sleep(0.002)

    def remove_if_empty(self) -> None:
        """rmdir the group where nothing uses it (a parent shared with concurrent creates)."""
        for d in self.all_dirs():
            try:
                d.rmdir()
            except OSError:
                pass


@cache
def _on_v2(mount: Path) -> bool:
    return (mount / "cgroup.controllers").is_file()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _rmtree_cgroup(d: Path) -> bool:
    """rmdir a cgroup and its children, deepest first; True if something is still busy."""
    try:
        d.rmdir()  # the common case: a leaf group whose processes are gone
        return False
    except FileNotFoundError:
        return False
    except OSError:
        pass
    busy = False
    for child in [c for c in d.iterdir() if c.is_dir()]:
        busy |= _rmtree_cgroup(child)
    try:
        d.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            raise BackendError(f"cannot remove cgroup {d}: {e}") from e
        busy = True
    return busy


def children(parent_rel: str) -> set[str]:
    """Names of the groups under a parent in any hierarchy (for reconcile)."""
    out: set[str] = set()
    for m in layout().roots:
        d = m / parent_rel
        if d.is_dir():
            out.update(c.name for c in d.iterdir() if c.is_dir())
    return out
