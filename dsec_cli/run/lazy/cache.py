"""The node's chunk cache: decoded chunks on local disk, keyed by their xxh3-128 id, shared by
every lazy mount (and so every sandbox and layer) on the node, bounded by a disk budget.

A chunk is verified (length and xxh3-128) before it is written and again when it is read
back, so a torn or corrupted cache file is a miss, never bytes handed to a sandbox. Files are
written under a temporary name and renamed, so concurrent mount daemons never see half a
chunk. The last use is the file's mtime; when the cache grows past its budget the oldest
files are removed until it is back under 90% of it (least recently used first).

A mount daemon writes behind: chunks it fetched are queued for a writer thread and served from
the queue meanwhile, so readers never wait for a cache file to be created (on ext4 that costs
a millisecond or more a file, more than fetching the chunk). Files being written are named
``tmp/<id>.<pid>.<n>``; `sweep` removes those of processes that are gone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from ...core.digests import chunk_id as xxh3_id

log = logging.getLogger(__name__)

#: after an eviction pass the cache holds at most this fraction of its budget
LOW_WATER = 0.9
#: a hit refreshes the last-use time only when it is older than this (saves a syscall per hit)
TOUCH_EVERY = 30.0


class ChunkCache:
    """``<root>/<aa>/<chunk id hex>`` holding each chunk's uncompressed bytes."""

    def __init__(self, root: Path, budget: int, *, write_behind: int = 0) -> None:
        self.root = Path(root)
        self.budget = budget
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._size: int | None = None  # estimate; rescanned when it passes the budget
        self._behind_max = write_behind  # bytes queued for the writer at most (0: none)
        self._behind: dict[bytes, bytes] = {}
        self._behind_bytes = 0
        self._queued = threading.Condition(threading.Lock())
        self._writer: threading.Thread | None = None
        self._dirs: set[str] = set()

    def sweep(self) -> None:
        """Remove partial files of processes that died while writing them (named
        ``<id>.<pid>.<n>``; a live process's are kept)."""
        for p in self.tmp.glob("*.*.*"):
            pid = p.name.split(".")[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                p.unlink(missing_ok=True)

    def _path(self, cid: bytes) -> Path:
        h = cid.hex()
        return self.root / h[:2] / h

    def get(self, cid: bytes, ulen: int) -> bytes | None:
        with self._queued:
            queued = self._behind.get(cid)
        if queued is not None:
            return queued  # verified before it was queued
        p = self._path(cid)
        try:
            with open(p, "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
        except FileNotFoundError:
            return None
        if len(data) != ulen or xxh3_id(data) != cid:
            log.warning("chunk cache file %s is corrupt; fetching the chunk again", p)
            p.unlink(missing_ok=True)
            return None
        if time.time() - st.st_mtime > TOUCH_EVERY:
            try:
                os.utime(p)
            except FileNotFoundError:
                pass  # evicted meanwhile: the bytes in hand are still good
        return data

    def has(self, cid: bytes) -> bool:
        return cid in self._behind or self._path(cid).exists()

    def put(self, cid: bytes, data: bytes) -> None:
        """Store verified bytes (the caller decoded and checked them): queued for the writer
        thread when this cache writes behind and its queue has room, else written now."""
        if self._behind_max:
            with self._queued:
                if cid in self._behind:
                    return
                if self._behind_bytes + len(data) <= self._behind_max:
                    self._behind[cid] = data
                    self._behind_bytes += len(data)
                    if self._writer is None:
                        self._writer = threading.Thread(target=self._write_queued,
                                                        name="cache-writer", daemon=True)
                        self._writer.start()
                    self._queued.notify()
                    return
        self._write(cid, data)

    def _write_queued(self) -> None:
        while True:
            with self._queued:
                while not self._behind:
                    self._queued.wait()
                cid, data = next(iter(self._behind.items()))
            try:
                self._write(cid, data)
            except OSError as e:  # a full disk: the chunk is fetched again when next needed
                log.warning("chunk cache: writing %s failed: %s", cid.hex(), e)
            with self._queued:
                del self._behind[cid]
                self._behind_bytes -= len(data)
                self._queued.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until queued chunks are written (True), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._queued:
            while self._behind:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queued.wait(left)
        return True

    def _write(self, cid: bytes, data: bytes) -> None:
        p = self._path(cid)
        if p.exists():
            return
        if p.parent.name not in self._dirs:
            p.parent.mkdir(exist_ok=True)
            self._dirs.add(p.parent.name)
        tmp = self.tmp / f"{cid.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.rename(tmp, p)
        with self._lock:
            if self._size is None:
                self._size = self.usage()
            else:
                self._size += len(data)
            over = self._size > self.budget
        if over:
            self.evict()

    def path_of(self, key: bytes) -> Path:
        return self._path(key)

    def adopt(self, key: bytes, tmp: Path) -> Path:
        """Move in a whole file the caller wrote under ``self.tmp`` and verified, as ``key``
        (the backing files of kernel-served lazy mounts; kernelfs.py)."""
        p = self._path(key)
        p.parent.mkdir(exist_ok=True)
        size = tmp.stat().st_size
        os.replace(tmp, p)
        with self._lock:
            self._size = self.usage() if self._size is None else self._size + size
            over = self._size > self.budget
        if over:
            self.evict()
        return p

    def usage(self) -> int:
        total = 0
        for d in self.root.iterdir():
            if len(d.name) != 2 or not d.is_dir():
                continue
            with os.scandir(d) as it:
                for e in it:
                    try:
                        total += e.stat().st_size
                    except FileNotFoundError:
                        pass
        return total

    def evict(self) -> int:
        """Remove least recently used chunks until the cache is under its low-water mark;
        one process at a time (an flock), so daemons do not evict the same files twice."""
        freed = 0
        with open(self.root / ".evict.lock", "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            files: list[tuple[float, int, str]] = []
            for d in self.root.iterdir():
                if len(d.name) != 2 or not d.is_dir():
                    continue
                with os.scandir(d) as it:
                    for e in it:
                        try:
                            st = e.stat()
                        except FileNotFoundError:
                            continue
                        files.append((st.st_mtime, st.st_size, e.path))
            total = sum(f[1] for f in files)
            target = int(self.budget * LOW_WATER)
            files.sort()
            for _, size, path in files:
                if total <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                total -= size
                freed += size
            with self._lock:
                self._size = total
        if freed:
            log.debug("chunk cache: evicted %d bytes, %d left", freed, total)
        return freed
