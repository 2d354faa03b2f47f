"""Starting and stopping lazy mounts from the node: one mount daemon per sandbox, serving all
of the image's layers under ``<sandbox dir>/lazy/mnt/<n>``; its state (config, statistics,
access profile, log) lives beside it in ``<sandbox dir>/lazy/``.

A mount is torn down with its sandbox (`cleanup`), and `Node.reconcile` calls the same
function for sandbox dirs nobody owns any more (after ``kill -9`` of dsec), so no FUSE mount
or daemon outlives its sandbox.
"""

from __future__ import annotations

import ctypes.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.config import env
from ...core.errors import BackendError, UsageError
from ...format.validate import is_digest

log = logging.getLogger(__name__)

FETCH_MODES = ("eager", "lazy", "background")
READY_TIMEOUT = 60.0


def available() -> str | None:
    """None when lazy mounts work here, else why not (the caller falls back to eager)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if os.geteuid() != 0:
        return "lazy mounts as overlay lower dirs need root"
    if served_by() == "kernel passthrough":
        return None  # speaks /dev/fuse itself: neither libfuse nor mfusepy is needed
    if not ctypes.util.find_library("fuse3"):
        return "libfuse3 is not installed (apt-get install fuse3)"
    import importlib.util

    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed; pip install 'dsec[lazy]'"
    return None


def served_by() -> str:
    """How lazy reads are served here (``dsec node check``): ``kernel passthrough`` (opened
    files are read by the kernel from backing files; kernelfs.py) or ``fuse daemon`` (every
    read goes through the libfuse daemon; fs.py), the fallback where the kernel lacks FUSE
    passthrough or ``DSEC_LAZY_SERVER=daemon``."""
    from .kernelfs import supported

    want = (env("DSEC_LAZY_SERVER") or "kernel").lower()
    if want not in ("kernel", "daemon"):
        raise UsageError(f"invalid DSEC_LAZY_SERVER {want!r}: choose kernel or daemon")
    if want == "daemon" or supported() is not None:
        return "fuse daemon"
    return "kernel passthrough"


@dataclass
class LazyMount:
    state: Path  # <sandbox dir>/lazy
    mountpoint: Path
    pid: int
    lower_dirs: list[Path]  # bottom first


def mount_layers(state: Path, store_url: str, layers: list[dict[str, str]], *, cache: Path,
                 budget: int, mode: str, record_seconds: float = 30.0,
                 max_read: int | None = None, inflight: int = 4) -> LazyMount:
    """Mount ``layers`` (dicts with ``index`` and ``content_digest``) lazily and wait until
    the filesystem answers. Raises BackendError when the daemon does not come up."""
    mnt = state / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    cfg = {"store": store_url, "layers": layers, "mountpoint": str(mnt), "cache": str(cache),
           "budget": budget, "mode": mode, "record_seconds": record_seconds,
           "max_read": max_read, "inflight": inflight, "ready_fd": w,
           "log": (env("DSEC_LOG") or "INFO").upper(),
           "server": "kernel" if served_by() == "kernel passthrough" else "daemon"}
    (state / "config.json").write_text(json.dumps(cfg))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsec_cli.run.lazy.mountd", str(state / "config.json")],
            pass_fds=(w,), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(state / "mountd.err", "ab"))  # noqa: SIM115
    finally:
        os.close(w)
    (state / "pid").write_text(f"{proc.pid} {_start_time(proc.pid)}")
    try:
        ready, _, _ = select.select([r], [], [], READY_TIMEOUT)
        ok = bool(ready) and os.read(r, 1) == b"R"
    finally:
        os.close(r)
    if not ok:
        cleanup(state)
        raise BackendError(f"the lazy mount daemon did not start: {_tail(state)}",
                           hint="retry with --fetch eager")
    return LazyMount(state, mnt, proc.pid, [mnt / str(n) for n in range(len(layers))])


def _tail(state: Path) -> str:
    for name in ("mountd.err", "mountd.log"):
        try:
            lines = (state / name).read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        if lines:
            return lines[-1]
    return "no output"


def _start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _daemon_pid(state: Path) -> int | None:
    try:
        pid_s, start_s = (state / "pid").read_text().split()
        pid = int(pid_s)
        if _start_time(pid) == int(start_s) and int(start_s):
            return pid
    except (OSError, ValueError):
        pass
    # no pid file (a crash before it was written, or the dir half removed): find it by its
    # command line, which names this mount's config
    want = str(state / "config.json").encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if want in argv and b"dsec_cli.run.lazy.mountd" in argv:
                return int(p.name)
    return None


def cleanup(state: Path, timeout: float = 5.0) -> None:
    """Unmount a lazy mount and end its daemon (quiet when there is none). The daemon writes
    its final statistics and profile when the filesystem goes away."""
    if not state.is_dir():
        return
    mnt = state / "mnt"
    from ...backends import _rootfs

    for mp in _rootfs.mounts_under(state):
        _rootfs.umount(mp)  # overlays over the mount first (deepest first), then FUSE itself
    if _is_mount(mnt):
        _rootfs.umount(mnt)
    pid = _daemon_pid(state)
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    sent = False
    while _start_time(pid):
        if _zombie(pid):
            break
        if time.monotonic() > deadline:
            if not sent:
                os.kill(pid, signal.SIGTERM)
                sent, deadline = True, time.monotonic() + timeout
            else:
                os.kill(pid, signal.SIGKILL)
                break
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _is_mount(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def read_stats(state: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads((state / "stats.json").read_text())
        return doc
    except (OSError, ValueError):
        return None


def save_profile(state: Path, profiles: Path, sandbox_id: str) -> None:
    """Keep a finished mount's access profile for `dsec optimize`:
    ``<profiles>/<layer content digest>/<sandbox id>.json`` (files and first-read times)."""
    try:
        doc = json.loads((state / "profile.json").read_text())
    except (OSError, ValueError):
        return
    for layer in doc.get("layers", []):
        if not layer.get("files") or not is_digest(layer.get("content_digest")):
            continue  # a profile is named by a verified content digest, nothing else
        d = profiles / layer["content_digest"]
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{sandbox_id}.tmp"
        tmp.write_text(json.dumps(layer["files"]))
        os.replace(tmp, d / f"{sandbox_id}.json")
