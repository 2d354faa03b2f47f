"""The node's chunk cache: decoded chunks on local disk, keyed by their xxh3-128 id, shared by
every lazy mount (and so every sandbox and layer) on the node, bounded by a disk budget.

A chunk is verified (length and xxh3-128) before it is written and again when it is read
back, so a torn or corrupted cache file is a miss, never bytes handed to a sandbox. Files are
written under a temporary name and renamed, so concurrent mount daemons never see half a
chunk. The last use is the file's mtime; when the cache grows past its budget the oldest
files are removed until it is back under 90% of it (least recently used first).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
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

    def __init__(self, root: Path, budget: int) -> None:
        self.root = Path(root)
        self.budget = budget
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._size: int | None = None  # estimate; rescanned when it passes the budget

    def _path(self, cid: bytes) -> Path:
        h = cid.hex()
        return self.root / h[:2] / h

    def get(self, cid: bytes, ulen: int) -> bytes | None:
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
        import time

        if time.time() - st.st_mtime > TOUCH_EVERY:
            try:
                os.utime(p)
            except FileNotFoundError:
                pass  # evicted meanwhile: the bytes in hand are still good
        return data

    def has(self, cid: bytes) -> bool:
        return self._path(cid).exists()

    def put(self, cid: bytes, data: bytes) -> None:
        """Store verified bytes (the caller decoded and checked them)."""
        p = self._path(cid)
        if p.exists():
            return
        p.parent.mkdir(exist_ok=True)
        tmp = self.tmp / f"{cid.hex()}.{uuid.uuid4().hex[:8]}"
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
