"""Read-ahead of a kernel-served lazy mount: a small file's chunks are fetched with the
chunks stored after them in their pack (the next files of a walk in packing order), a read
in the last such window starts the next one in the background, and the bytes of small files
whose chunks are in memory are handed to the compiled loop, which then answers their reads
without this process."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .fs import LazyFS, Node

log = logging.getLogger(__name__)

SMALL_FILE = 256 << 10  # files up to this size bring their pack neighbours along
#: files up to this size get no backing file: their few reads are answered from memory (making
#: a named file can cost a millisecond or more on a contended ext4, more than the reads)
INLINE_FILE = 128 << 10


class ReadAhead:
    """The read-ahead windows and the small files' tables of one mount. ``loop`` is the
    compiled loop's tables once mounted (None: the Python loop answers every read)."""

    def __init__(self, fs: LazyFS, inodes: dict[int, tuple[str, Node]]) -> None:
        self.fs = fs
        self.inodes = inodes
        self.loop: Any = None
        self.lock = threading.Lock()
        self._order: dict[int, tuple[list[int], dict[int, int]]] = {}
        # per layer, the last read-ahead window: its chunks and its last one in pack order
        self._windows: dict[int, tuple[frozenset[int], int]] = {}
        self.ahead = ThreadPoolExecutor(1, thread_name_prefix="ahead")
        self._small: dict[int, dict[int, list[int]]] = {}  # layer -> chunk -> small files
        self._held: set[bytes] = set()  # chunks whose bytes the loop serves small files from

    def close(self) -> None:
        self.ahead.shutdown(wait=False, cancel_futures=True)

    def fetch_with_neighbours(self, node: Node) -> None:
        """A small file's chunks, fetched (when missing) with the chunks that follow them in
        their pack in the same ranged read: the next files of a walk then come from memory or
        the chunk cache. A larger file is fetched alone: one request is worth its bytes."""
        if node.entry.size > SMALL_FILE:
            return
        src = self.fs.sources[node.layer]
        own = [ci for ci, _, _ in node.entry.chunks]
        if all(src.fetcher.in_memory(src.index.chunks[ci].chunk_id) for ci in own):
            self.publish(node.layer, own)
            return
        following = self._following(node.layer, own)
        src.fetcher.chunks(src.index, own, readahead=following)
        if following:
            with self.lock:
                old = self._windows.get(node.layer)
                self._windows[node.layer] = (frozenset(following), following[-1])
            if old is not None:
                self.arm(node.layer, old[0], False)
        self.publish(node.layer, own + following)
        # on a warm node the neighbours were not fetched (they are in the chunk cache):
        # read them from the disk ahead of the walk, with the members of the file's chunk
        # group stored before it (a walk's order is not quite the packing order)
        before = [s for ci in own for s in src.fetcher.siblings(src.index, ci)
                  if s not in own and s not in following]
        ahead = list(dict.fromkeys(before + following))
        src.fetcher.preload(src.index, ahead, then=lambda got: self.publish(node.layer, got))

    def sequential(self, node: Node) -> None:
        """A read of a file in its layer's last read-ahead window is a walk in pack order:
        the window after it is loaded now in the background (from memory, the chunk cache or
        the store in coalesced reads), so the walk finds it in memory instead of waiting."""
        w = self._windows.get(node.layer)
        if w is None or not any(ci in w[0] for ci, _, _ in node.entry.chunks):
            return
        with self.lock:
            if self._windows.get(node.layer) is not w:
                return  # another read took this window's turn
            del self._windows[node.layer]
        self.arm(node.layer, w[0], False)
        nxt = self._following(node.layer, [w[1]])
        if nxt:
            with self.lock:
                self._windows.setdefault(node.layer, (frozenset(nxt), nxt[-1]))
            self.ahead.submit(self._load_ahead, node.layer, nxt)

    def _load_ahead(self, layer: int, idxs: list[int]) -> None:
        src = self.fs.sources[layer]
        if self.loop is not None:
            # chunks in the node's chunk cache: read by the preloaders in parallel and handed
            # to the loop as they arrive; the rest fetched from the store below
            cached = [i for i in idxs if src.fetcher.cache.has(src.index.chunks[i].chunk_id)]
            src.fetcher.preload(src.index, cached, then=lambda got: self.publish(layer, got))
            idxs = sorted(set(idxs) - set(cached))
        try:
            src.fetcher.chunks(src.index, idxs, count_stall=False)
        except Exception as e:  # readers fetch on demand, and get EIO only from their own fetch
            log.warning("lazy mount: reading ahead in layer %d failed: %s", layer, e)
            return
        self.publish(layer, idxs)

    # -- the compiled loop's tables -----------------------------------------------------------
    def _small_files(self, layer: int) -> dict[int, list[int]]:
        """Per chunk number, the inodes of the small files (answered from memory) of
        ``layer`` that have bytes in it."""
        with self.lock:
            got = self._small.get(layer)
            if got is None:
                got = self._small[layer] = {}
                for ino, (_, node) in self.inodes.items():
                    e = node.entry
                    if node.layer == layer and e.type == "reg" and 0 < e.size <= INLINE_FILE:
                        for ci, _, _ in e.chunks:
                            got.setdefault(ci, []).append(ino)
        return got

    def publish(self, layer: int, idxs: list[int]) -> None:
        """Hand the compiled loop the bytes of the small files stored in chunks ``idxs``
        whose chunks are all in memory (decoded and verified by the fetcher): their reads are
        then answered there. Files of the layer's read-ahead window are marked so that their
        first read there still starts the next window (`PassthroughServer._walked`)."""
        if self.loop is None:
            return
        src = self.fs.sources[layer]
        files = self._small_files(layer)
        w = self._windows.get(layer)
        done: set[int] = set()
        for ci in idxs:
            for ino in files.get(ci, ()):
                if ino in done or self.loop.has_data(ino):
                    continue
                done.add(ino)
                e = self.inodes[ino][1].entry
                parts = []
                for c, off, ln in e.chunks:
                    data = src.fetcher.recall(src.index.chunks[c].chunk_id)
                    if data is None:
                        break
                    parts.append((data, off, ln))
                else:
                    armed = w is not None and any(c in w[0] for c, _, _ in e.chunks)
                    if len(parts) == 1:  # served from the chunk's bytes, not a copy: the
                        data, off, ln = parts[0]  # chunk counts once against the budget
                        cid = src.index.chunks[e.chunks[0][0]].chunk_id
                        cost = 0 if cid in self._held else len(data)
                    else:
                        data = b"".join(d[o:o + n] for d, o, n in parts)
                        off, ln, cost, cid = 0, len(data), len(data), None
                    if not self.loop.set_data(ino, data, armed, off, ln, cost):
                        return  # the loop's budget is spent: the rest is answered here
                    if cid is not None:
                        self._held.add(cid)

    def arm(self, layer: int, chunks: frozenset[int], on: bool) -> None:
        """Whether reads of the small files in ``chunks`` answered by the loop are reported
        (the window's read-ahead starts with the first of them)."""
        if self.loop is None:
            return
        files = self._small_files(layer)
        for ci in chunks:
            for ino in files.get(ci, ()):
                self.loop.set_notify(ino, on)

    def _following(self, layer: int, own: list[int]) -> list[int]:
        """Chunk numbers stored right after ``own`` in their pack, up to one preferred read."""
        with self.lock:
            order = self._order.get(layer)
            if order is None:
                ix = self.fs.sources[layer].index
                seq = sorted(range(len(ix.chunks)),
                             key=lambda i: (ix.chunks[i].pack, ix.chunks[i].offset))
                order = self._order[layer] = (seq, {c: n for n, c in enumerate(seq)})
        seq, pos = order
        src = self.fs.sources[layer]
        budget = src.fetcher.max_read
        out: list[int] = []
        pack, end = -1, 0  # the stored range read so far
        for ci in seq[max(pos[c] for c in own) + 1:] if own else ():
            loc = src.index.chunks[ci]
            # the members of a chunk group overlap (each runs to the end of the group's
            # frame): a member costs only the bytes it adds to the range
            more = loc.offset + loc.clen - end if loc.pack == pack and loc.offset < end \
                else loc.clen
            budget -= max(more, 0)
            if budget < 0:
                break
            out.append(ci)
            end = max(end, loc.offset + loc.clen) if loc.pack == pack else loc.offset + loc.clen
            pack = loc.pack
        return out
