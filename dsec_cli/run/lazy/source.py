"""Chunks of a lazily mounted layer, on demand: memory, then the node's chunk cache, then the
store, with neighbouring chunks of one pack fetched by one ranged read.

Depends on a ``fetch(pack, offset, length)`` function, never on a store class. A mount shares
one `Fetcher` (a bounded number of requests in flight, statistics) among its layers; each
layer has a `LayerSource` over its index.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ...core.digests import chunk_id as xxh3_id
from ...core.errors import IntegrityError
from ...format.codec import CODEC_ZGROUP
from ...format.index import ChunkLoc, Entry, LayerIndex
from ...format.reader import decode_run, spans
from .cache import ChunkCache

log = logging.getLogger(__name__)

Fetch = Callable[[str, int, int], bytes]


@dataclass
class Stats:
    """What a mount cost: the figures `dsec ps --json` reports per sandbox."""

    bytes_fetched: int = 0  # compressed bytes read from the store
    requests: int = 0  # ranged reads sent to the store
    bytes_from_cache: int = 0  # uncompressed bytes served from the node's chunk cache
    bytes_served: int = 0  # bytes handed to readers of the mount
    stall_seconds: float = 0.0  # time readers waited for the store
    fetch_errors: int = 0
    prefetched_files: int = 0
    background_done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: counts kept elsewhere (the compiled FUSE loop's bytes served), added when read
    pull: Callable[[], dict[str, int]] | None = field(default=None, repr=False)

    def add(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def public(self) -> dict[str, object]:
        more = self.pull() if self.pull is not None else {}
        with self.lock:
            out = {k: (round(v, 6) if isinstance(v, float) else v)
                   for k, v in self.__dict__.items() if k not in ("lock", "pull")}
        for k, v in more.items():
            out[k] += v
        return out


#: threads reading chunks of the node's chunk cache ahead of a walk (`Fetcher.preload`): the
#: disk serves several reads at once, and the walk waits for the slowest
PRELOADERS = 4


class Fetcher:
    """The store side of one mount: bounded requests in flight, one fetch per chunk even when
    several readers miss it at once, a small memory cache of decoded chunks."""

    def __init__(self, fetch: Fetch, cache: ChunkCache, *, max_read: int, inflight: int = 4,
                 memory: int = 64 << 20) -> None:
        self.fetch = fetch
        self.cache = cache
        self.max_read = max_read
        self.stats = Stats()
        self.slots = threading.BoundedSemaphore(inflight)
        self._mem: OrderedDict[bytes, bytes] = OrderedDict()
        self._mem_bytes = 0
        self._mem_budget = memory
        self._lock = threading.Lock()
        self._pending: dict[bytes, threading.Event] = {}
        self._loading: set[bytes] = set()  # chunks `preload` is reading from the disk cache
        self._loader: ThreadPoolExecutor | None = None
        #: per index: the members of each chunk group, by (pack, where the group ends)
        self._groups: dict[int, tuple[LayerIndex, dict[tuple[int, int], list[int]]]] = {}

    def siblings(self, index: LayerIndex, i: int) -> list[int]:
        """The chunks stored in one group with chunk ``i`` (empty for a chunk alone)."""
        return self._siblings(index, i)

    def _siblings(self, index: LayerIndex, i: int) -> list[int]:
        """The chunks stored in one group with chunk ``i`` (codec 2), itself included: one
        range holds them all, so they are fetched and decoded together, never one by one."""
        loc = index.chunks[i]
        if loc.codec != CODEC_ZGROUP:
            return []
        known = self._groups.get(id(index))
        if known is None or known[0] is not index:
            groups: dict[tuple[int, int], list[int]] = {}
            for j, c in enumerate(index.chunks):
                if c.codec == CODEC_ZGROUP:
                    groups.setdefault((c.pack, c.offset + c.clen), []).append(j)
            with self._lock:
                known = self._groups[id(index)] = (index, groups)
        return known[1].get((loc.pack, loc.offset + loc.clen), [])

    # -- memory cache --------------------------------------------------------------------------
    def _remember(self, cid: bytes, data: bytes) -> None:
        with self._lock:
            if cid in self._mem:
                self._mem.move_to_end(cid)
                return
            self._mem[cid] = data
            self._mem_bytes += len(data)
            while self._mem_bytes > self._mem_budget and self._mem:
                _, old = self._mem.popitem(last=False)
                self._mem_bytes -= len(old)

    def in_memory(self, cid: bytes) -> bool:
        """Whether a chunk is in the memory cache now (a hint: it may be evicted meanwhile)."""
        return cid in self._mem

    def _recall(self, cid: bytes) -> bytes | None:
        with self._lock:
            data = self._mem.get(cid)
            if data is not None:
                self._mem.move_to_end(cid)
            return data

    def recall(self, cid: bytes) -> bytes | None:
        """A chunk's decoded, verified bytes if they are in the memory cache now."""
        return self._recall(cid)

    def preload(self, index: LayerIndex, idxs: list[int],
                then: Callable[[list[int]], None] | None = None) -> None:
        """Read chunks ``idxs`` of the node's chunk cache into memory in the background,
        never from the store (so no bytes fetched): the next files of a walk over a warm cache
        are then answered without waiting for the disk. ``then`` is given the chunk numbers
        in memory as they arrive (at once those already there)."""
        with self._lock:
            todo = [i for i in idxs if index.chunks[i].chunk_id not in self._mem
                    and index.chunks[i].chunk_id not in self._loading]
            if todo:
                self._loading.update(index.chunks[i].chunk_id for i in todo)
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(PRELOADERS, thread_name_prefix="preload")
            loader = self._loader
        if then is not None:
            loading = set(todo)
            self._then(then, [i for i in idxs if i not in loading])
        # interleaved between the loaders, so the first chunks (the walk's next) come first
        for k in range(min(PRELOADERS, len(todo))):
            assert loader is not None  # made above when there is anything to load
            loader.submit(self._load, index, todo[k::PRELOADERS], then)

    def _then(self, then: Callable[[list[int]], None], idxs: list[int]) -> None:
        try:
            then(idxs)
        except Exception as e:  # a hint only: readers are answered without it
            log.warning("after preloading chunks: %s", e)

    def _load(self, index: LayerIndex, idxs: list[int],
              then: Callable[[list[int]], None] | None = None) -> None:
        try:
            for i in idxs:
                loc = index.chunks[i]
                if loc.chunk_id in self._mem:
                    continue
                data = self.cache.get(loc.chunk_id, loc.ulen)
                if data is None:
                    break  # not cached: readers fetch it (and its neighbours) themselves
                self.stats.add(bytes_from_cache=len(data))
                self._remember(loc.chunk_id, data)
                if then is not None:
                    self._then(then, [i])
        finally:
            with self._lock:
                self._loading.difference_update(index.chunks[i].chunk_id for i in idxs)

    # -- fetching ------------------------------------------------------------------------------
    def chunks(self, index: LayerIndex, idxs: list[int], *, readahead: Iterable[int] = (),
               count_stall: bool = True, gap: int = 0) -> dict[int, bytes]:
        """Decoded, verified chunks ``idxs`` of one index. Missing ones are fetched together
        with missing ``readahead`` chunks that extend their runs (same pack, contiguous)."""
        out: dict[int, bytes] = {}
        missing: list[int] = []
        for i in dict.fromkeys(idxs):
            loc = index.chunks[i]
            data = self._recall(loc.chunk_id)
            if data is None:
                data = self.cache.get(loc.chunk_id, loc.ulen)
                if data is not None:
                    self.stats.add(bytes_from_cache=len(data))
                    self._remember(loc.chunk_id, data)
            if data is None:
                missing.append(i)
            else:
                out[i] = data
        if not missing:
            return out
        started = time.monotonic()
        try:
            self._fetch_missing(index, missing, readahead, out, gap)
        finally:
            if count_stall:
                self.stats.add(stall_seconds=time.monotonic() - started)
        return out

    def _fetch_missing(self, index: LayerIndex, missing: list[int], readahead: Iterable[int],
                       out: dict[int, bytes], gap: int) -> None:
        want = set(missing)
        siblings = [s for i in missing for s in self._siblings(index, i)]
        extra = [i for i in dict.fromkeys([*siblings, *readahead]) if i not in want
                 and not self.cache.has(index.chunks[i].chunk_id)]
        mine: list[int] = []  # chunks this call fetches; others wait for their fetcher
        waits: list[tuple[int, threading.Event]] = []
        with self._lock:
            for i in [*missing, *extra]:
                cid = index.chunks[i].chunk_id
                if cid in self._mem:  # another fetch (a read-ahead) brought it meanwhile
                    if i in want:
                        out[i] = self._mem[cid]
                    continue
                ev = self._pending.get(cid)
                if ev is None:
                    self._pending[cid] = threading.Event()
                    mine.append(i)
                elif i in want:
                    waits.append((i, ev))
        try:
            for run in runs(index, sorted(mine, key=lambda i: (index.chunks[i].pack,
                                                               index.chunks[i].offset)),
                            self.max_read, gap):
                got = self._fetch_run(index, run)
                for i, data in got.items():
                    if i in want:
                        out[i] = data
        finally:
            with self._lock:
                for i in mine:
                    ev = self._pending.pop(index.chunks[i].chunk_id, None)
                    if ev is not None:
                        ev.set()
        for i, ev in waits:
            ev.wait()
            loc = index.chunks[i]
            one = self._recall(loc.chunk_id) or self.cache.get(loc.chunk_id, loc.ulen)
            if one is None:  # the other fetch failed: try once more ourselves
                one = self._fetch_run(index, [i])[i]
            out[i] = one

    def _fetch_run(self, index: LayerIndex, run: list[int]) -> dict[int, bytes]:
        locs = [index.chunks[i] for i in run]
        start = locs[0].offset
        length = max(loc.offset + loc.clen for loc in locs) - start  # group members overlap
        pack = index.packs[locs[0].pack]
        with self.slots:
            try:
                blob = self.fetch(pack, start, length)
            except Exception:
                self.stats.add(fetch_errors=1)
                raise
        self.stats.add(bytes_fetched=len(blob), requests=1)
        if len(blob) != length:
            raise IntegrityError(f"pack {pack[:12]} is truncated (asked {length} bytes at "
                                 f"{start}, got {len(blob)})")
        got: dict[int, bytes] = {}
        for i, data in decode_run(index, run, start, memoryview(blob)).items():
            loc = index.chunks[i]
            check(index, loc, data)
            self.cache.put(loc.chunk_id, data)
            self._remember(loc.chunk_id, data)
            got[i] = data
        return got


def check(index: LayerIndex, loc: ChunkLoc, data: bytes) -> bytes:
    """A decoded chunk, refused unless it is the chunk the index names."""
    if len(data) != loc.ulen or xxh3_id(data) != loc.chunk_id:
        raise IntegrityError(f"chunk {loc.chunk_id.hex()} in pack {index.packs[loc.pack][:12]} "
                             "is corrupt (xxh3-128 mismatch)")
    if loc.sha256 is not None and hashlib.sha256(data).digest() != loc.sha256:
        raise IntegrityError(f"chunk {loc.chunk_id.hex()} in pack {index.packs[loc.pack][:12]} "
                             "is corrupt (sha256 mismatch)")
    return data


def runs(index: LayerIndex, idxs: list[int], max_read: int, gap: int = 0) -> list[list[int]]:
    """Chunk numbers (sorted by pack and offset) in runs one ranged read can fetch
    (`format.reader.spans`: one pack, at most ``gap`` bytes between neighbours, the members
    of a chunk group together, at most max_read bytes in all)."""
    return [run for run, _, _ in spans(index, idxs, max_read, gap)]


class LayerSource:
    """Reads of one layer's files: byte ranges -> chunks -> bytes."""

    def __init__(self, index: LayerIndex, fetcher: Fetcher) -> None:
        self.index = index
        self.fetcher = fetcher
        self._starts: dict[int, list[int]] = {}  # id(entry) -> file offset of each extent

    def _extent_starts(self, entry: Entry) -> list[int]:
        key = id(entry)
        starts = self._starts.get(key)
        if starts is None:
            starts, pos = [], 0
            for _, _, ln in entry.chunks:
                starts.append(pos)
                pos += ln
            self._starts[key] = starts
        return starts

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        if offset >= entry.size or size <= 0:
            return b""
        end = min(entry.size, offset + size)
        starts = self._extent_starts(entry)
        first = bisect.bisect_right(starts, offset) - 1
        last = bisect.bisect_left(starts, end) - 1
        exts = entry.chunks[first:last + 1]
        # read ahead inside this file only, up to one preferred read of compressed bytes
        ahead: list[int] = []
        budget = self.fetcher.max_read
        for ci, _, _ in entry.chunks[last + 1:]:
            budget -= self.index.chunks[ci].clen
            if budget < 0:
                break
            ahead.append(ci)
        data = self.fetcher.chunks(self.index, [c for c, _, _ in exts], readahead=ahead)
        parts = []
        for n, (ci, off, ln) in enumerate(exts, start=first):
            s, e = max(offset, starts[n]), min(end, starts[n] + ln)
            parts.append(data[ci][off + s - starts[n]:off + e - starts[n]])
        out = b"".join(parts)
        self.fetcher.stats.add(bytes_served=len(out))
        return out

    def chunk_numbers(self, entries: Iterable[Entry]) -> list[int]:
        seen: dict[int, None] = {}
        for e in entries:
            for ci, _, _ in e.chunks:
                seen[ci] = None
        return list(seen)

    def warm(self, idxs: list[int], *, gap: int = 64 << 10, workers: int = 2,
             stop: threading.Event | None = None) -> None:
        """Fetch chunks into the cache in (pack, offset) order, neighbours coalesced even
        across small gaps (prefetch and background fetch: throughput over precision)."""
        todo = [i for i in dict.fromkeys(idxs)
                if not self.fetcher.cache.has(self.index.chunks[i].chunk_id)]
        todo.sort(key=lambda i: (self.index.chunks[i].pack, self.index.chunks[i].offset))
        groups = runs(self.index, todo, self.fetcher.max_read, gap)

        def one(run: list[int]) -> None:
            if stop is not None and stop.is_set():
                return
            self.fetcher.chunks(self.index, run, count_stall=False, gap=gap)

        with ThreadPoolExecutor(max(1, workers)) as ex:
            for f in [ex.submit(one, r) for r in groups]:
                f.result()
