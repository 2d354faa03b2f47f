"""Writer leases and the gc deletion marker: the handshake that makes store gc safe while
other clients build and push.

A writer (build, push, pull, snapshot) puts ``leases/<id>`` before it checks what the store
holds, renews it while it runs and deletes it when done. Store gc, before deleting anything,
puts ``gc/deleting``, *then* reads the leases, and deletes only if none is live; a writer,
after putting its lease, waits while a live ``gc/deleting`` exists. Whichever of the two
wrote first is seen by the other (stores are read-after-write consistent), so a writer
never reuses an object that gc is about to delete. docs/stores.md has the whole argument.

A gc that dies (killed, or its machine lost) must not hold writers up for long, so the
marker is a heartbeat, not a promise for the whole run: gc renews it every few seconds with
a short expiry (``DSEC_GC_MARKER_TTL``, 60 s) and deletes only while its last renewal is
less than half that old. Both the marker and the leases also record who wrote them (host,
boot id, PID namespace, pid and the process's start time): a writer on the same machine
sees at once that the process behind a marker is gone and goes on without waiting, and a
writer elsewhere waits at most until the heartbeat expires.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..core.config import debug_delay, env
from ..core.errors import DsecError, NotFoundError, StoreError
from .stores.base import Store

log = logging.getLogger(__name__)

LEASES = "leases/"
DELETING = "gc/deleting"
DEFAULT_TTL = 600.0  # a writer that stops renewing is presumed dead after this
DEFAULT_MARKER_TTL = 60.0  # a gc that stops renewing its marker is presumed dead after this


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(env(name) or default)
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


def _ttl() -> float:
    return _env_seconds("DSEC_LEASE_TTL", DEFAULT_TTL)


def _marker_ttl() -> float:
    return _env_seconds("DSEC_GC_MARKER_TTL", DEFAULT_MARKER_TTL)


# -- who holds a lease or the marker ----------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with
    the pid it names one process, even after the pid is reused."""
    stat = _read(f"/proc/{pid}/stat")
    fields_ = stat.rpartition(")")[2].split()
    return fields_[19] if len(fields_) > 19 else ""


def _machine() -> dict[str, str]:
    """What tells this machine and PID namespace from any other: a pid is only meaningful
    between processes that agree on all three."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns}


def _process() -> dict[str, Any]:
    pid = os.getpid()
    return {**_machine(), "pid": pid, "start": _start_time(pid)}


def process_gone(proc: object) -> bool:
    """True only when ``proc`` names a process of this machine and PID namespace that no
    longer runs (its pid is free, or now belongs to a process started later). Anything
    else, another machine included, is not known to be gone."""
    if not isinstance(proc, dict):
        return False
    mine = _machine()
    if not mine["boot"] or any(proc.get(k) != v for k, v in mine.items()):
        return False
    pid, start = proc.get("pid"), proc.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not start:
        return False
    now = _start_time(pid)
    if now:
        return now != start
    try:  # /proc/PID hidden (hidepid) or gone: ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists but is not ours to signal
    return False  # it exists and its start time cannot be read: cannot tell


@dataclass(frozen=True)
class LeaseInfo:
    key: str
    purpose: str
    holder: str
    started: float
    expires: float
    process: dict[str, Any] | None = None

    def live(self, now: float | None = None) -> bool:
        if self.expires <= (time.time() if now is None else now):
            return False
        return not process_gone(self.process)


def _decode(key: str, data: bytes) -> LeaseInfo | None:
    try:
        doc = json.loads(data)
        proc = doc.get("process")
        return LeaseInfo(key, str(doc.get("purpose", "")), str(doc.get("holder", "")),
                         float(doc["started"]), float(doc["expires"]),
                         proc if isinstance(proc, dict) else None)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # a malformed lease is no lease; gc reports and removes it


def read_leases(store: Store) -> list[LeaseInfo]:
    out = []
    for info in store.list(LEASES):
        try:
            lease = _decode(info.key, store.get(info.key))
        except NotFoundError:
            continue  # released while listing
        if lease is None:
            lease = LeaseInfo(info.key, "malformed", "", info.mtime, info.mtime)
        out.append(lease)
    return out


def read_marker(store: Store) -> LeaseInfo | None:
    try:
        marker = _decode(DELETING, store.get(DELETING))
    except NotFoundError:
        return None
    if marker is not None and marker.expires > time.time() and process_gone(marker.process):
        # left by a gc killed on this machine: stale, whatever its expiry says. It is not
        # deleted here: a new gc may be replacing it this very moment, and the next gc
        # run overwrites it anyway.
        log.warning("%s: ignoring the gc marker of %s, which no longer runs (a killed "
                    "gc); the next `dsec gc` replaces it", store.url, marker.holder)
    return marker


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class WriterLease:
    """``with WriterLease(store, "push"):`` around every write that may reuse stored objects."""

    def __init__(self, store: Store, purpose: str, ttl: float | None = None,
                 wait_timeout: float | None = None) -> None:
        self.store = store
        self.purpose = purpose
        self.ttl = ttl or _ttl()
        self.wait_timeout = self.ttl if wait_timeout is None else wait_timeout
        self.key = f"{LEASES}{uuid.uuid4().hex}"
        self.started = time.time()
        self.lost = False  # a renewal failed: the lease may have expired under us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        now = time.time()
        doc = {"purpose": self.purpose, "holder": _holder(), "started": self.started,
               "expires": now + self.ttl, "process": _process()}
        self.store.put(self.key, json.dumps(doc).encode())

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self._write()
            except DsecError as e:
                self.lost = True
                log.warning("could not renew writer lease %s: %s", self.key, e)

    def __enter__(self) -> WriterLease:
        self._write()
        try:
            self._wait_for_gc()
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._renew, name="dsec-lease", daemon=True)
        self._thread.start()
        return self

    def _wait_for_gc(self) -> None:
        deadline = time.monotonic() + self.wait_timeout
        while (marker := read_marker(self.store)) is not None and marker.live():
            if time.monotonic() > deadline:
                raise StoreError(f"{self.store.url} is being garbage-collected by "
                                 f"{marker.holder}; try again when it is done")
            log.info("waiting for gc on %s to finish deleting", self.store.url)
            time.sleep(0.2)

    def _release(self) -> None:
        try:
            self.store.delete(self.key)
        except DsecError as e:  # an orphan lease only delays gc until it expires
            log.warning("could not release writer lease %s: %s", self.key, e)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._release()


class GcMarker:
    """``with GcMarker(store) as marker:`` around gc's deletions.

    Puts ``gc/deleting`` and renews it every ``ttl / 6`` seconds with an expiry ``ttl``
    ahead. `may_delete` is true only while the last successful renewal began less than
    ``ttl / 2`` ago, so gc stops deleting well before a writer could see the marker expire
    (a renewal that fails, or a process that stalls, simply lets it lapse)."""

    def __init__(self, store: Store, ttl: float | None = None) -> None:
        self.store = store
        self.ttl = ttl or _marker_ttl()
        self.started = time.time()
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        began = time.time()
        doc = {"purpose": "gc", "holder": _holder(), "started": self.started,
               "expires": began + self.ttl, "process": _process()}
        self.store.put(DELETING, json.dumps(doc).encode())
        self._valid_until = began + self.ttl / 2

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 6):
            try:
                self._write()
            except DsecError as e:
                log.warning("could not renew the gc marker: %s; deletion stops", e)

    def may_delete(self) -> bool:
        """Whether one more object may be deleted now (pauses first when the
        ``DSEC_DEBUG_DELAY_GC_DELETE`` test hook asks for it)."""
        pause = debug_delay("gc_delete")
        if pause:
            time.sleep(pause)
        return time.time() < self._valid_until

    def __enter__(self) -> GcMarker:
        self._write()
        self._thread = threading.Thread(target=self._renew, name="dsec-gc-marker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.store.delete(DELETING)
