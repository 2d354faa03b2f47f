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
from .codec import CODEC_ZGROUP, decode, decode_group
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

    def _check(self, loc: ChunkLoc, data: bytes) -> bytes:
        if len(data) != loc.ulen or chunk_id(data) != loc.chunk_id:
            raise IntegrityError(
                f"chunk {loc.chunk_id.hex()} in pack {self.index.packs[loc.pack]} is corrupt "
                "(xxh3-128 mismatch)")
        if loc.sha256 is not None and hashlib.sha256(data).digest() != loc.sha256:
            raise IntegrityError(
                f"chunk {loc.chunk_id.hex()} in pack {self.index.packs[loc.pack]} is corrupt "
                "(sha256 mismatch)")
        return data

    def _decode_run(self, run: list[int], start: int, view: memoryview) -> dict[int, bytes]:
        """Decode and verify the chunks of one fetched range."""
        decoded = decode_run(self.index, run, start, view)
        return {i: self._check(self.index.chunks[i], data) for i, data in decoded.items()}

    def _remember(self, i: int, data: bytes) -> None:
        self._cache[i] = data
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _runs(self, idxs: list[int]) -> Iterator[tuple[list[int], int, int]]:
        return spans(self.index, idxs, self.max_read)

    def chunks(self, idxs: list[int]) -> Iterator[tuple[int, bytes]]:
        """Decoded chunks in the order asked, fetching uncached ones in coalesced runs."""
        # taken now: remembering fetched chunks below may evict these from the small cache
        fetched: dict[int, bytes] = {i: self._cache[i] for i in idxs if i in self._cache}
        pending = [i for i in dict.fromkeys(idxs) if i not in fetched]
        for run, start, end in self._runs(pending):
            pack = self.index.packs[self.index.chunks[run[0]].pack]
            length = end - start
            blob = self.fetch(pack, start, length)
            self.bytes_fetched += len(blob)
            if len(blob) != length:
                raise IntegrityError(f"pack {pack} is truncated")
            fetched.update(self._decode_run(run, start, memoryview(blob)))
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


def spans(index: LayerIndex, idxs: list[int], max_read: int, gap: int = 0
          ) -> Iterator[tuple[list[int], int, int]]:
    """Group chunk numbers (sorted by pack and offset) into runs that one ranged read of one
    pack covers: (run, start, end). A chunk joins the run when its range starts inside it or
    at most ``gap`` bytes after it (members of one chunk group overlap: they all end where
    the group's frame ends), and the run stays within ``max_read`` bytes."""
    run: list[int] = []
    start = end = 0
    for i in idxs:
        loc = index.chunks[i]
        if run:
            prev = index.chunks[run[-1]]
            new_end = max(end, loc.offset + loc.clen)
            if (loc.pack != prev.pack or not start <= loc.offset <= end + gap
                    or new_end - start > max_read):
                yield run, start, end
                run = []
            else:
                end = new_end
        if not run:
            start, end = loc.offset, loc.offset + loc.clen
        run.append(i)
    if run:
        yield run, start, end


def decode_run(index: LayerIndex, run: list[int], start: int, view: memoryview
               ) -> dict[int, bytes]:
    """The chunks of one fetched range (``view`` holds the pack's bytes from ``start``),
    decoded but not yet verified; the members of one chunk group (codec 2, their ranges
    ending together) are decompressed in one pass. A chunk that does not decode raises
    `IntegrityError` naming it and its pack."""
    out: dict[int, bytes] = {}
    groups: dict[int, list[int]] = {}
    for i in run:
        loc = index.chunks[i]
        if loc.codec == CODEC_ZGROUP:
            groups.setdefault(loc.offset + loc.clen, []).append(i)
            continue
        rel = loc.offset - start
        try:
            out[i] = decode(loc.codec, view[rel:rel + loc.clen], loc.ulen)
        except IntegrityError as e:
            raise _corrupt(index, loc, e) from e
    for end, members in groups.items():
        locs = [index.chunks[i] for i in members]
        first = min(loc.offset for loc in locs)
        try:
            datas = decode_group(view[first - start:end - start], [loc.ulen for loc in locs],
                                 [loc.offset - first for loc in locs])
        except IntegrityError as e:
            raise _corrupt(index, locs[0], e) from e
        out.update(zip(members, datas, strict=True))
    return out


def _corrupt(index: LayerIndex, loc: ChunkLoc, e: IntegrityError) -> IntegrityError:
    return IntegrityError(f"chunk {loc.chunk_id.hex()} in pack {index.packs[loc.pack]} is "
                          f"corrupt: {e.message}")
