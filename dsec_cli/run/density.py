"""Density on one node: memory reclamation (`park`, `thaw`, the idle-reclaim policy), the
per-sandbox figures `dsec top` shows, what the host offers for it (swap, KSM, cgroup v1/v2
controllers) and `dsec node setup` (a swap file, KSM on and tuned). docs/density.md.

Reclamation acts on a sandbox's cgroup (`Backend.cgroup`): for containers and fncall sandboxes
the group of everything inside, for VMs the QEMU process's group (guest RAM is QEMU's private
anonymous memory). `park` stops the sandbox (freezer, or QEMU `stop`) and pushes its memory
out (page cache dropped, anonymous pages to swap where there is swap); `thaw` lets it run
again, and its pages come back as they are touched: files and processes are as they were.
The idle policy reclaims without stopping, from sandboxes no exec has touched for a while.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import BACKENDS, _cgroups, backend_class
from ..core.errors import DsecError, SandboxError, UsageError

if TYPE_CHECKING:
    from ..backends import Backend, SandboxHandle
    from .node import Node
    from .state import SandboxRecord

log = logging.getLogger(__name__)

ACTIVE = "active"  # per-sandbox file whose mtime is the last exec's start or end
RECLAIM = "reclaim.json"  # per-sandbox figures of the last reclaim
KSM = Path("/sys/kernel/mm/ksm")
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- activity ------------------------------------------------------------------------------------
def touch(sdir: Path) -> None:
    """Mark the sandbox active now (one utime: cheap enough for every exec)."""
    p = sdir / ACTIVE
    try:
        os.utime(p)
    except FileNotFoundError:
        try:
            p.touch()
        except OSError:
            pass  # the sandbox is going away
    except OSError:
        pass


def idle_seconds(sdir: Path, created: float) -> float:
    try:
        last = (sdir / ACTIVE).stat().st_mtime
    except OSError:  # never exec'd: idle since it was made
        last = created
    return max(0.0, time.time() - last)


def _cgroup(node: Node, rec: SandboxRecord) -> _cgroups.Cgroup | None:
    rel = node.backend(rec.backend).cgroup(node.handle_of(rec))
    return _cgroups.Cgroup(rel) if rel else None


def _read_reclaim(sdir: Path) -> dict[str, Any]:
    try:
        doc = json.loads((sdir / RECLAIM).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_reclaim(sdir: Path, doc: dict[str, Any]) -> None:
    tmp = sdir / (RECLAIM + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(sdir / RECLAIM)


# -- per-sandbox figures -------------------------------------------------------------------------
def usage(node: Node, rec: SandboxRecord) -> dict[str, Any]:
    """What one sandbox declared and what it uses: ``resident`` and ``swapped`` bytes now,
    ``reclaimed`` by its last reclaim, CPU seconds, class and idle time."""
    sdir = node.sandboxes_dir / rec.id
    limits = rec.spec.get("limits", {})
    out: dict[str, Any] = {"id": rec.id, "backend": rec.backend, "status": rec.status,
                           "class": limits.get("cpu_class") or "batch",
                           "declared_memory": limits.get("memory"),
                           "declared_cpus": limits.get("cpus"),
                           "idle_seconds": round(idle_seconds(sdir, rec.created), 1)}
    cg = _cgroup(node, rec) if rec.status in ("running", "paused", "parked") else None
    if cg is not None:
        out.update(cg.memory_use())
        out["cpu_seconds"] = cg.cpu_seconds()
        pid = (rec.handle or {}).get("pid")
        if pid and rec.status != "parked" and backend_class(rec.backend).is_vm:
            out["ksm_merged"] = _ksm_merged(pid)
    last = _read_reclaim(sdir)
    out["reclaimed"] = int(last.get("reclaimed", 0))
    out["reclaimed_at"] = last.get("at")
    if rec.status == "parked" and last.get("state_bytes"):
        out["parked_to_file"] = int(last["state_bytes"])
    return out


def top(node: Node, interval: float = 0.0) -> list[dict[str, Any]]:
    """Every sandbox's `usage`; with ``interval``, CPU use as a fraction of one CPU over
    that many seconds (two samples)."""
    if not (isinstance(interval, int | float) and 0 <= interval <= 60):
        raise UsageError(f"invalid interval {interval!r}: between 0 and 60 seconds")
    recs = node.sandboxes(reconcile=False)
    first = [usage(node, r) for r in recs]
    if interval <= 0:
        return first
    time.sleep(interval)
    out = []
    for r, a in zip(recs, first, strict=True):
        b = usage(node, r)
        if a.get("cpu_seconds") is not None and b.get("cpu_seconds") is not None:
            b["cpu"] = round((b["cpu_seconds"] - a["cpu_seconds"]) / interval, 3)
        out.append(b)
    return out


# -- park / thaw / idle reclaim ------------------------------------------------------------------
def _reclaim(node: Node, rec: SandboxRecord, cg: _cgroups.Cgroup, parked: bool
             ) -> dict[str, Any]:
    before = cg.memory_use()
    freed = cg.reclaim()
    after = cg.memory_use()
    doc = {"reclaimed": freed, "at": time.time(), "parked": parked,
           "resident_before": before.get("resident", 0)}
    _write_reclaim(node.sandboxes_dir / rec.id, doc)
    return {"id": rec.id, "status": "parked" if parked else rec.status, "reclaimed": freed,
            "resident_before": before.get("resident", 0), **after}


def park(node: Node, sid: str) -> dict[str, Any]:
    """Stop a running sandbox and push its memory out; `thaw` brings it back. A VM is saved
    to a state file and its QEMU ends (backends/vm/vmpark.py)."""
    rec, b, h = node.live(sid)
    if b.park_mechanism == "state-file":
        return _park_vm(node, rec, b, h)
    cg = _cgroup(node, rec)
    if cg is None:
        raise UsageError(f"{rec.backend} sandbox {rec.id} has no cgroup to reclaim from")
    if not b.supports_pause:
        raise UsageError(f"{rec.backend} sandboxes cannot be stopped, so cannot be parked")
    b.pause(h)
    node.db.update(rec.id, status="parked")
    try:
        return _reclaim(node, rec, cg, parked=True)
    except DsecError:
        b.resume(h)  # a sandbox is never left stopped by a park that failed
        node.db.update(rec.id, status="running")
        raise


def _park_vm(node: Node, rec: SandboxRecord, b: Backend, h: SandboxHandle) -> dict[str, Any]:
    node.db.update(rec.id, status="parked")  # before the save: reconcile then knows to look
    try:
        figures = b.park(h)
    except BaseException:
        node.db.update(rec.id, status="running")  # the guest runs on (vmpark.park)
        raise
    cg = _cgroup(node, rec)
    if cg is not None:  # the state file's page cache, charged to the group that wrote it
        try:
            cg.reclaim()
        except DsecError as e:
            log.warning("sandbox %s: dropping the state file's page cache failed: %s",
                        rec.id, e)
    doc = {"reclaimed": figures["resident_before"], "at": time.time(), "parked": True,
           "resident_before": figures["resident_before"], "mechanism": "qemu-migrate-file",
           "state_bytes": figures["state_bytes"]}
    _write_reclaim(node.sandboxes_dir / rec.id, doc)
    return {"id": rec.id, "status": "parked", **{k: v for k, v in doc.items() if k != "at"},
            "save_seconds": figures["save_seconds"], "resident": 0}


def _thaw_vm(node: Node, rec: SandboxRecord, b: Backend, h: SandboxHandle) -> dict[str, Any]:
    def commit(state: dict[str, Any]) -> None:
        node.db.update(rec.id, handle=state)

    rec.handle = b.thaw(h, commit, (rec.spec.get("limits") or {}).get("cpu_class"))
    node.db.update(rec.id, status="running", handle=rec.handle)
    touch(node.sandboxes_dir / rec.id)
    rec.status = "running"
    return usage(node, rec)


def thaw(node: Node, sid: str) -> dict[str, Any]:
    """Let a parked sandbox run again (its pages come back from swap as they are used; a
    VM's from its state file)."""
    rec = node.lookup(sid)
    if rec.status != "parked":
        raise UsageError(f"sandbox {rec.id} is not parked (it is {rec.status})")
    b, h = node.backend(rec.backend), node.handle_of(rec)
    if b.park_mechanism == "state-file" and b.is_alive(h):
        return _thaw_vm(node, rec, b, h)
    if not b.is_alive(h):
        node.db.update(rec.id, status="dead")
        raise SandboxError(f"sandbox {rec.id} is no longer running",
                           hint=f"remove it with `dsec rm {rec.id}`")
    b.resume(h)
    node.db.update(rec.id, status="running")
    touch(node.sandboxes_dir / rec.id)
    rec.status = "running"
    return usage(node, rec)


def prewarm(node: Node, sid: str, settle: float = 30.0) -> dict[str, Any]:
    """Bring a sandbox back ahead of need: thawed if parked, and its memory read back from
    swap now (`prefetch`) instead of page by page as its next commands touch it. Its usage,
    with ``prefetched`` (bytes asked back) and ``prewarm_seconds``."""
    t0 = time.monotonic()
    rec = node.lookup(sid)
    if rec.status == "parked":
        thaw(node, sid)
    elif rec.status != "running":
        raise UsageError(f"sandbox {rec.id} cannot be pre-warmed (it is {rec.status})")
    cg = _cgroup(node, rec)
    asked = prefetch(cg, settle) if cg is not None else 0
    rec = node.lookup(sid)
    return {**usage(node, rec), "prefetched": asked,
            "prewarm_seconds": round(time.monotonic() - t0, 4)}


_SYS_PIDFD_OPEN, _SYS_PROCESS_MADVISE = 434, 440  # one number on every architecture
_MADV_WILLNEED = 3
_IOV_MAX = 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _private_ranges(pid: int) -> list[tuple[int, int]]:
    """The process's writable private mappings (heap, stacks, anonymous and copy-on-write
    file memory): what swap can hold of it."""
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split()
                perms = fields[1]
                if len(fields) >= 6 and fields[5].startswith("[v"):  # [vdso], [vvar]...
                    continue
                if "w" in perms and perms[3] == "p":
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    out.append((lo, hi - lo))
    except OSError:  # gone meanwhile
        return []
    return out


def _willneed(pid: int, ranges: list[tuple[int, int]]) -> int:
    """Ask the kernel to read ``ranges`` of ``pid`` back from swap now (process_madvise
    MADV_WILLNEED: reads start at once, the call does not wait for them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        return 0
    asked = 0
    try:
        for i in range(0, len(ranges), _IOV_MAX):
            batch = ranges[i:i + _IOV_MAX]
            iov = (_IoVec * len(batch))(*[_IoVec(lo, n) for lo, n in batch])
            done = libc.syscall(_SYS_PROCESS_MADVISE, pidfd, iov, len(batch),
                                _MADV_WILLNEED, 0)
            if done < 0:
                err = ctypes.get_errno()
                if err in (errno.ESRCH, errno.ENOMEM, errno.EFAULT):  # exited or unmapped
                    continue
                log.debug("process_madvise(%d): %s", pid, os.strerror(err))
                return asked
            asked += done
    finally:
        os.close(pidfd)
    return asked


def prefetch(cg: _cgroups.Cgroup, settle: float = 30.0) -> int:
    """Read a sandbox's swapped-out memory back in for every process of its group, and wait
    (up to ``settle`` seconds) until its resident memory stops growing. Bytes asked for."""
    asked = sum(_willneed(pid, _private_ranges(pid)) for pid in cg.procs())
    deadline = time.monotonic() + settle
    seen: list[int] = []
    while time.monotonic() < deadline:  # steady for three samples: the reads are done
        seen = [*seen[-2:], cg.memory_use().get("resident", 0)]
        if len(seen) == 3 and seen[0] == seen[2]:
            break
        time.sleep(0.05)
    return asked
def recover_parked(node: Node, rec: SandboxRecord) -> str | None:
    """After a crash mid-park or mid-thaw of a VM: no partial state file, no QEMU beside a
    complete one (vmpark.recover); what was done, or None."""
    if rec.status != "parked" or backend_class(rec.backend).park_mechanism != "state-file":
        return None
    from ..backends.vm import vmpark

    return vmpark.recover(node.backend(rec.backend), node.handle_of(rec))  # type: ignore[arg-type]


def reclaim_idle(node: Node, after: float, dry_run: bool = False) -> list[dict[str, Any]]:
    """Reclaim from running sandboxes no exec has touched for ``after`` seconds and that
    were not reclaimed since (they keep running; their next exec faults pages back in)."""
    out = []
    for rec in node.db.all():
        if rec.status != "running":
            continue
        sdir = node.sandboxes_dir / rec.id
        idle = idle_seconds(sdir, rec.created)
        last = _read_reclaim(sdir).get("at") or 0.0
        if idle < after or last > time.time() - idle:
            continue
        cg = _cgroup(node, rec)
        if cg is None:
            continue
        if dry_run:
            out.append({"id": rec.id, "idle_seconds": round(idle, 1)})
            continue
        try:
            out.append(_reclaim(node, rec, cg, parked=False))
        except DsecError as e:
            log.warning("idle reclaim of %s failed: %s", rec.id, e)
    return out


def resident_total(node: Node) -> int:
    """Bytes all this node's sandboxes hold in RAM now (the node's parent group: one read)."""
    return int(_cgroups.Cgroup(node.cgroup_parent).memory_use().get("resident", 0))


# -- the host ------------------------------------------------------------------------------------
def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * 1024
    return out


def ksm_state() -> dict[str, Any]:
    """KSM's switch and what it saves now (pages_sharing pages are deduplicated away)."""
    if not (KSM / "run").exists():
        return {"available": False}
    out: dict[str, Any] = {"available": True}
    for name in ("run", "pages_to_scan", "sleep_millisecs", "pages_shared", "pages_sharing",
                 "use_zero_pages", "ksm_zero_pages", "full_scans"):
        try:
            out[name] = int((KSM / name).read_text())
        except (OSError, ValueError):
            pass
    # pages merged with the zero page (use_zero_pages) are saved too
    out["saved_bytes"] = (out.get("pages_sharing", 0) + out.get("ksm_zero_pages", 0)) * PAGE
    return out


def _ksm_merged(pid: int) -> int:
    """Bytes of a process's memory KSM merged with identical pages elsewhere."""
    try:
        return int(Path(f"/proc/{int(pid)}/ksm_merging_pages").read_text()) * PAGE
    except (OSError, ValueError):
        return 0


@cache
def criu_state() -> dict[str, Any]:
    """Whether CRIU could checkpoint container processes here: installed, and `criu check`
    passing on this kernel (Debian 12's criu 3.17 fails it on recent kernels). dsec does
    not checkpoint with CRIU; this says whether a host could."""
    exe = shutil.which("criu")
    if exe is None:
        return {"installed": False, "usable": False, "reason": "criu is not installed"}
    try:
        r = subprocess.run([exe, "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"installed": True, "usable": False, "reason": f"criu check: {e}"}
    last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or [""]
    return {"installed": True, "usable": r.returncode == 0,
            "reason": "criu check passed" if r.returncode == 0 else f"criu check: {last[0]}"}


def zswap_enabled() -> bool:
    try:
        return Path("/sys/module/zswap/parameters/enabled").read_text().strip() in ("Y", "1")
    except OSError:
        return False


def park_mechanisms(swap_total: int | None = None) -> dict[str, str]:
    """How `park` keeps each backend's memory out of RAM on this host."""
    if swap_total is None:
        swap_total = _meminfo().get("SwapTotal", 0)
    where = ("memory reclaimed to zswap, then swap" if zswap_enabled() else
             "memory reclaimed to swap") if swap_total else \
        "page cache dropped, anonymous memory stays (no swap)"
    frozen = f"frozen (cgroup freezer), {where}"
    to_file = "QEMU migration of the guest to a state file, QEMU ended (all its RAM freed)"
    how = {"freezer": frozen, "state-file": to_file}
    return {name: how[backend_class(name).park_mechanism] for name in BACKENDS}


def host_facts() -> dict[str, Any]:
    """What this host offers for density, each with the fallback used where it is missing."""
    lay = _cgroups.layout()
    probe = _cgroups.Cgroup("")
    controllers = {c: ("v2" if probe.is_v2(c) else "v1") if c in lay.mounts else None
                   for c in ("cpu", "cpuacct", "memory", "freezer", "pids")}
    mem = lay.mounts.get("memory")
    cpu = lay.mounts.get("cpu")
    info = _meminfo()
    notes = []
    if not info.get("SwapTotal"):
        notes.append("no swap: reclaim drops page cache only, anonymous memory stays "
                     "(add swap with `dsec node setup --swap SIZE`)")
    ksm = ksm_state()
    if not ksm["available"]:
        notes.append("no KSM in this kernel: VM guest memory is not merged")
    elif not ksm.get("run"):
        notes.append("KSM is off: VM guest memory is not merged (`dsec node setup --ksm`)")
    reclaim = None
    if mem is not None:
        reclaim = "memory.reclaim" if probe.is_v2("memory") and (mem / "memory.reclaim").exists() \
            else "memory.force_empty" if (mem / "memory.force_empty").exists() else "limit"
    else:
        notes.append("no memory controller: no reclamation, no resident figures")
    cpu_idle = cpu is not None and (cpu / "cpu.idle").exists()
    if cpu is None:
        notes.append("no cpu controller: CPU classes are recorded but not applied")
    elif not cpu_idle:
        notes.append("no cpu.idle: the idle class gets the smallest weight instead")
    slices = _cgroups.custom_slices()
    if cpu is not None and not slices:
        notes.append("no per-task EEVDF slices (kernel before 6.12): latency-class wake-ups "
                     "wait for the scheduler's tick under batch load")
    criu = criu_state()
    if not criu["usable"]:
        notes.append(f"no process checkpoints ({criu['reason']}): container and fncall "
                     "sandboxes park in place and thaw on the same node only")
    from ..backends.egress import host_facts as egress_facts

    egress = egress_facts()
    if egress["missing"]:
        notes.append("network allowlist unavailable: missing " + ", ".join(egress["missing"])
                     + " (scripts/setup.sh installs iproute2 and iptables)")
    return {"cgroup_controllers": controllers, "reclaim": reclaim, "cpu_idle": cpu_idle,
            "custom_slices": slices,
            "swap_total": info.get("SwapTotal", 0), "swap_free": info.get("SwapFree", 0),
            "zswap": zswap_enabled(), "ksm": ksm,
            "park": park_mechanisms(info.get("SwapTotal", 0)), "criu": criu, "egress": egress,
            "notes": notes}


def setup(swap: int | None = None, swap_file: Path | None = None,
          ksm: bool | None = None, ksm_pages: int | None = None) -> dict[str, Any]:
    """Prepare this host: a swap file of ``swap`` bytes (made, formatted and enabled unless
    one is already on at ``swap_file``), KSM on or off and its scan rate."""
    out: dict[str, Any] = {}
    if swap is not None:
        path = Path(swap_file or "/var/lib/dsec/swapfile").absolute()
        out["swap"] = add_swap(path, swap)
    if ksm is not None or ksm_pages is not None:
        if not (KSM / "run").exists():
            raise UsageError("this kernel has no KSM (/sys/kernel/mm/ksm)")
        try:
            if ksm_pages is not None:
                (KSM / "pages_to_scan").write_text(str(ksm_pages))
            if ksm and (KSM / "use_zero_pages").exists():
                # guests zero what they free (init_on_free, set on VMs booted while KSM
                # runs): such pages are merged with the kernel's zero page, costing nothing
                (KSM / "use_zero_pages").write_text("1")
            if ksm is not None:
                (KSM / "run").write_text("1" if ksm else "0")
        except OSError as e:
            raise UsageError(f"cannot set KSM: {e}", hint="run as root") from e
        out["ksm"] = ksm_state()
    out["host"] = host_facts()
    return out


def _active_swaps() -> set[str]:
    with open("/proc/swaps") as f:
        return {line.split()[0] for line in f.read().splitlines()[1:] if line.split()}


def add_swap(path: Path, size: int) -> dict[str, Any]:
    """Make and enable a swap file (kept as it is if it is already on)."""
    if str(path) in _active_swaps():
        return {"file": str(path), "size": path.stat().st_size, "already": True}
    if size < (40 << 10):
        raise UsageError(f"invalid --swap {size}: a swap file needs at least 40 KiB")
    if path.exists():
        raise UsageError(f"{path} exists and is not an active swap file: not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        for argv in (["mkswap", str(path)], ["swapon", str(path)]):
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                raise UsageError(f"{argv[0]} {path} failed: {proc.stderr.strip()}",
                                 hint="the file must be on a local filesystem such as ext4")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return {"file": str(path), "size": size, "already": False}


def remove_swap(path: Path) -> None:
    """Turn a swap file off (its pages come back to RAM) and delete it."""
    if str(path) in _active_swaps():
        subprocess.run(["swapoff", str(path)], check=True, capture_output=True)
    path.unlink(missing_ok=True)
