"""Snapshot boot for the microvm and vm backends: a guest booted once per (machine, image,
kernel, memory, CPUs, network, pids and disk limits) to a ready agent is saved, and later
sandboxes with the same key are created by restoring it instead of booting.

A template is a directory ``<vm dir>/templates/<key>/`` holding ``state`` (QEMU's migration
stream of the stopped guest: RAM and device state) and ``disk.ext4`` (the writable disk as the
guest left it when it was stopped). It is built inside the create that first needs it, in a
build dir and under a guest name derived from that sandbox's id (so a kill at any point leaves
only what the sandbox's teardown removes), and renamed into place complete. A restore copies
the disk (each sandbox writes its own copy), starts QEMU with the same devices, reading the
stream from an open file descriptor (`open_state`, `incoming_fd_argv`: no ``cat`` process and
pipe in between, the file read ahead into the page cache), and the guest runs as soon as it is
loaded; its first agent round trip is the agent's identity request, which gives it its own
hostname, a CRNG reseeded from host randomness and a fresh machine id where the image has one
(in the agent itself: no process is started in the guest for it). QEMU 7.2 reads the whole
stream at restore (its ``mapped-ram`` format, which maps RAM on demand, arrived in 9.0).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...core.errors import BackendError
from .qemu_qmp import QMPError, qmp

#: bump when what a template holds changes (2: no run state; 3: no identity helper, the agent
#: takes the identity itself)
FORMAT = 3


def _stamp(p: Path) -> list[Any]:
    st = p.stat()
    return [str(p), st.st_size, st.st_mtime_ns]


def template_key(parts: dict[str, Any], files: list[Path]) -> tuple[str, str]:
    """The key of a template: every argument that shapes the guest, and the identity (path,
    size, mtime) of every file it boots from; and the document it digests (kept with the
    template as ``key.json``)."""
    doc = json.dumps({"format": FORMAT, **parts, "files": [_stamp(f) for f in files]},
                     sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:24], doc


def template_dir(vm_dir: Path, key: str) -> Path:
    return vm_dir / "templates" / key


def build_dir(vm_dir: Path, sid: str) -> Path:
    """Where the create of sandbox ``sid`` builds a template (beside the templates, so the
    result is renamed into place; removed with the sandbox)."""
    return vm_dir / "templates" / f".build-{sid}"


def ready(tdir: Path) -> bool:
    return (tdir / "state").is_file() and (tdir / "disk.ext4").is_file()


@contextmanager
def build_lock(vm_dir: Path, key: str) -> Iterator[None]:
    """One builder per template at a time (others wait, then restore what it saved)."""
    d = vm_dir / "templates"
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / f".{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def save(qmp_path: str, out: Path, timeout: float) -> None:
    """Stop the guest and write its migration stream to ``out`` (QEMU keeps running)."""
    qmp(qmp_path, "stop")
    qmp(qmp_path, "migrate", {"uri": f"exec:cat > {_quote(out)}"})
    deadline = time.monotonic() + timeout
    while True:
        info = qmp(qmp_path, "query-migrate") or {}
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise BackendError(f"saving the VM snapshot failed: {info.get('error-desc', status)}")
        if time.monotonic() > deadline:
            raise BackendError(f"saving the VM snapshot took over {timeout:.0f}s")
        time.sleep(0.05)


def incoming_argv(tdir: Path) -> list[str]:
    return ["-incoming", f"exec:cat {_quote(tdir / 'state')}"]


def open_state(tdir: Path) -> int:
    """The template's migration stream opened for QEMU to read (`incoming_fd_argv`; pass it
    to QEMU, then close it here), with the kernel asked to read it ahead into the page cache
    while QEMU starts. The caller closes it."""
    fd = os.open(tdir / "state", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # advice only
    return fd


def incoming_fd_argv(fd: int) -> list[str]:
    """QEMU loads the stream from ``fd`` (inherited: pass it with ``pass_fds``). A stream
    saved without run state (the QEMU that saved it ran with
    ``-global migration.store-global-state=off``, as templates do) starts the guest the moment
    it is loaded, with no ``cont`` round trip; one saved with it restores that state (a guest
    stopped to be saved stays paused: `wait_restored` resumes it)."""
    return ["-incoming", f"fd:{fd}"]


def wait_loaded(qmp_path: str, timeout: float, alive: Any, done: tuple[str, ...],
                what: str) -> str:
    """Wait until QEMU has read an incoming stream: its status once it is one of ``done``;
    a failed load (QEMU ended or in error) or ``timeout`` raises, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = (qmp(qmp_path, "query-status", timeout=5) or {}).get("status")
        except QMPError:
            status = None  # the control socket may not be listening yet
        if status in done:
            return str(status)
        if status in ("internal-error", "shutdown", "guest-panicked") or not alive():
            raise BackendError(f"{what} failed (QEMU status {status})")
        if time.monotonic() > deadline:
            raise BackendError(f"{what} took over {timeout:.0f}s")
        time.sleep(0.02)


def wait_restored(qmp_path: str, timeout: float, alive: Any) -> None:
    """Wait for the incoming stream to be loaded, then let the guest run."""
    status = wait_loaded(qmp_path, timeout, alive, ("paused", "postmigrate", "running"),
                         "restoring the VM snapshot")
    if status != "running":
        qmp(qmp_path, "cont")


def touch(tdir: Path) -> None:
    """Mark a template used now (what `prune` goes by)."""
    try:
        os.utime(tdir)
    except OSError:
        pass


def prune(vm_dir: Path, max_age: float, dry_run: bool = False) -> list[str]:
    """Remove saved boots no restore used for ``max_age`` seconds (node gc); their keys.
    A removed one is built again by the next create that needs it."""
    root = vm_dir / "templates"
    if not root.is_dir():
        return []
    out = []
    now = time.time()
    for d in root.iterdir():
        if d.name.startswith(".") or not d.is_dir():
            continue
        try:
            idle = now - d.stat().st_mtime
        except OSError:
            continue
        if idle <= max_age:
            continue
        out.append(d.name)
        if not dry_run:
            gone = root / f".evict-{d.name}-{os.getpid()}"
            try:
                os.rename(d, gone)  # atomic: a restore starting now builds it again
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)
    return out


def copy_disk(src: Path, dest: Path) -> None:
    """The sandbox's own writable disk: a sparse (or reflinked) copy of the template's."""
    r = subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(src), str(dest)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BackendError(f"copying the snapshot disk failed: {r.stderr.strip()}")


def _quote(p: Path) -> str:
    import shlex

    return shlex.quote(str(p))
