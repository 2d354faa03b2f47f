"""Reading file bytes back out of a layer index, through a fetch function.

The reader depends on ``fetch(pack_digest, offset, length) -> bytes`` only, never on a store
class, so the same code serves exports, the node cache and lazy mounts. Neighbouring chunks of
one pack are fetched with one ranged read; every chunk is verified after decoding.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ..core.digests import chunk_id
from ..core.errors import IntegrityError
from .codec import decode
from .index import ChunkLoc, Entry, LayerIndex

Fetch = Callable[[str, int, int], bytes]


class ChunkReader:
    def __init__(self, index: LayerIndex, fetch: Fetch, *, max_read: int = 4 << 20,
                 cache_size: int = 32) -> None:
        self.index = index
        self.fetch = fetch
        self.max_read = max_read
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_size = cache_size
        self.bytes_fetched = 0

    def _decode(self, i: int, loc: ChunkLoc, stored: bytes | memoryview) -> bytes:
        try:
            data = decode(loc.codec, stored, loc.ulen)
        except IntegrityError as e:
            raise IntegrityError(f"chunk {loc.chunk_id.hex()} in pack "
                                 f"{self.index.packs[loc.pack]} is corrupt: {e.message}") from e
        if len(data) != loc.ulen or chunk_id(data) != loc.chunk_id:
            raise IntegrityError(
                f"chunk {loc.chunk_id.hex()} in pack {self.index.packs[loc.pack]} is corrupt "
                "(xxh3-128 mismatch)")
        if loc.sha256 is not None and hashlib.sha256(data).digest() != loc.sha256:
            raise IntegrityError(
                f"chunk {loc.chunk_id.hex()} in pack {self.index.packs[loc.pack]} is corrupt "
                "(sha256 mismatch)")
        return data

    def _remember(self, i: int, data: bytes) -> None:
        self._cache[i] = data
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _runs(self, idxs: list[int]) -> Iterator[list[int]]:
        """Group chunk numbers into runs that are contiguous in one pack."""
        run: list[int] = []
        size = 0
        for i in idxs:
            loc = self.index.chunks[i]
            if run:
                prev = self.index.chunks[run[-1]]
                if (loc.pack != prev.pack or loc.offset != prev.offset + prev.clen
                        or size + loc.clen > self.max_read):
                    yield run
                    run, size = [], 0
            run.append(i)
            size += loc.clen
        if run:
            yield run

    def chunks(self, idxs: list[int]) -> Iterator[tuple[int, bytes]]:
        """Decoded chunks in the order asked, fetching uncached ones in coalesced runs."""
        # taken now: remembering fetched chunks below may evict these from the small cache
        fetched: dict[int, bytes] = {i: self._cache[i] for i in idxs if i in self._cache}
        pending = [i for i in dict.fromkeys(idxs) if i not in fetched]
        for run in self._runs(pending):
            first = self.index.chunks[run[0]]
            last = self.index.chunks[run[-1]]
            length = last.offset + last.clen - first.offset
            blob = self.fetch(self.index.packs[first.pack], first.offset, length)
            self.bytes_fetched += len(blob)
            if len(blob) != length:
                raise IntegrityError(f"pack {self.index.packs[first.pack]} is truncated")
            view = memoryview(blob)
            for i in run:
                loc = self.index.chunks[i]
                rel = loc.offset - first.offset
                fetched[i] = self._decode(i, loc, view[rel:rel + loc.clen])
        for i in idxs:
            data = fetched[i]
            self._remember(i, data)
            yield i, data

    def read_file(self, entry: Entry) -> Iterator[bytes]:
        """The bytes of a regular file, in pieces."""
        # fetch a bounded window of chunks at a time so huge files stream
        window: list[tuple[int, int, int]] = []
        wsize = 0
        for ext in entry.chunks:
            window.append(ext)
            wsize += self.index.chunks[ext[0]].clen
            if wsize >= self.max_read:
                yield from self._emit(window)
                window, wsize = [], 0
        if window:
            yield from self._emit(window)

    def _emit(self, window: list[tuple[int, int, int]]) -> Iterator[bytes]:
        data = dict(self.chunks([i for i, _, _ in window]))
        for i, off, ln in window:
            chunk = data[i]
            yield chunk if (off == 0 and ln == len(chunk)) else chunk[off:off + ln]
