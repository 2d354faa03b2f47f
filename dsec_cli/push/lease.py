"""Writer leases and the gc deletion marker: the handshake that makes store gc safe while
other clients build and push.

A writer (build, push, pull, snapshot) puts ``leases/<id>`` before it checks what the store
holds, renews it while it runs and deletes it when done. Store gc, before deleting anything,
puts ``gc/deleting``, *then* reads the leases, and deletes only if none is live; a writer,
after putting its lease, waits while a live ``gc/deleting`` exists. Whichever of the two
wrote first is seen by the other (stores are read-after-write consistent), so a writer
never reuses an object that gc is about to delete. docs/stores.md has the whole argument.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..core.errors import DsecError, NotFoundError, StoreError
from .stores.base import Store

log = logging.getLogger(__name__)

LEASES = "leases/"
DELETING = "gc/deleting"
DEFAULT_TTL = 600.0  # a writer that stops renewing is presumed dead after this


def _ttl() -> float:
    try:
        return float(os.environ.get("DSEC_LEASE_TTL", DEFAULT_TTL))
    except ValueError:
        return DEFAULT_TTL


@dataclass(frozen=True)
class LeaseInfo:
    key: str
    purpose: str
    holder: str
    started: float
    expires: float

    def live(self, now: float | None = None) -> bool:
        return self.expires > (time.time() if now is None else now)


def _decode(key: str, data: bytes) -> LeaseInfo | None:
    try:
        doc = json.loads(data)
        return LeaseInfo(key, str(doc.get("purpose", "")), str(doc.get("holder", "")),
                         float(doc["started"]), float(doc["expires"]))
    except (ValueError, KeyError, TypeError):
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
        return _decode(DELETING, store.get(DELETING))
    except NotFoundError:
        return None


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
               "expires": now + self.ttl}
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
