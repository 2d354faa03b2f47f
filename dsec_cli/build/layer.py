"""The layer writer: entries -> chunks -> packs + index + manifest, deduplicated against
the store; the caller writes the ref last.

Files are read in batches on a read-ahead thread (the compiled reader releases the GIL);
chunking and hashing run on the calling thread; zstd compression (which releases the GIL)
runs on a pool, one task per group of new chunks (up to 1 MiB, compressed as one zstd frame
that every member can still be read from alone: format/codec.py), with a bounded window of
groups in flight, and results are appended to packs in submission order so the output is
deterministic.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import queue
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from ..core.config import load_config
from ..core.digests import chunk_id, object_key
from ..core.errors import BuildError
from ..core.files import fsync_path, remove_tree
from ..format.chunker import cut
from ..format.codec import GROUP_BYTES, GROUP_CHUNKS, Piece, encode_parts
from ..format.index import ChunkLoc, ChunkParams, Entry, EntryJson, LayerIndex, put_index
from ..format.manifest import Manifest, put_manifest
from ..format.pack import FinishedPack, PackWriter
from ..format.refs import commit_ref
from ..format.tree import Scanned, ScanReport, parent_of, read_many, scan_dir
from ..format.validate import layer_xattrs
from ..push.dedup import KnownChunk, KnownChunks
from ..push.stores.base import Store

log = logging.getLogger(__name__)

PACK_TARGET = 32 << 20
#: progress events: ("files", n) as entries are processed, ("bytes", n) as data is chunked
Progress = Callable[[str, int], None]


@dataclass
class WriteStats:
    new_chunks: int = 0
    new_bytes: int = 0  # compressed bytes written to new packs
    reused_chunks: int = 0
    packs_written: list[str] = field(default_factory=list)


#: threads that upload (or, for a file store, fsync) writers' sealed packs, for the process
UPLOAD_THREADS = 8
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A pool for every writer of the process, made on first use: writers come and go (an
    import makes one per layer), the threads stay, instead of each writer starting its own
    and each of its first tasks waiting for a thread to start."""
    with _pools_lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"dsec-{name}")
        return pool


def _forget_pools() -> None:
    """In a forked child the pools' threads are gone: it starts pools of its own."""
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


class _Buffers:
    """Buffers of a few sizes, kept once given back for the next writer or stream of the
    process: memory already faulted in, instead of new memory taken, zeroed and faulted in
    for every layer of an import (fresh buffers were most of an import's page faults).
    At most ``keep`` of each size are kept."""

    def __init__(self, keep: int) -> None:
        self.lock = threading.Lock()
        self.keep = keep
        self.free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        with self.lock:
            kept = self.free.get(size)
            if kept:
                return kept.pop()
        return bytearray(size)

    def give(self, bufs: list[bytearray]) -> None:
        with self.lock:
            for buf in bufs:
                kept = self.free.setdefault(len(buf), [])
                if len(kept) < self.keep:
                    kept.append(buf)


_BUFFERS = _Buffers(keep=8)


class ClaimLost(Exception):
    """A chunk this writer took from another writer of its run is not there: that writer's
    layer failed."""


#: new chunks are compressed in groups of up to GROUP_BYTES (or GROUP_CHUNKS chunks), one
#: pool task per group: the group shares one zstd frame's context (format/codec.py)

#: a chunk waiting for its group to be compressed: (chunk number, id, uncompressed length)
_Job = tuple[int, bytes, int]
_Encoded = tuple[list[Piece], list[tuple[int, int, int]]]
#: chunk id -> (writer, chunk number) of the first writer of a run to meet it
Claims = dict[bytes, tuple["_Writer", int]]


class _Writer:
    def __init__(self, store: Store, known: KnownChunks, params: ChunkParams,
                 staging: Path, progress: Progress | None, crypto: bool,
                 defer_uploads: bool = False, claims: Claims | None = None) -> None:
        self.store = store
        #: chunk id -> (writer, chunk number) of the writer that met it first, shared by the
        #: writers of one import run: a chunk another writer claimed is not compressed
        #: again here but taken from that writer's packs once it has sealed them
        #: (`take_claimed`)
        self.claims = claims if not crypto else None
        self.claimed: list[tuple[int, _Writer, int]] = []  # (here, owner, there)
        self.sealed = threading.Event()  # set by the owner of the writer: `seal_done`
        self.ok = False
        self.published = False  # its packs uploaded (`publish`)
        #: sealed packs kept in staging until `publish` (a stream not yet verified)
        self.defer_uploads = defer_uploads
        self.deferred: list[FinishedPack] = []
        self.known = known
        self.params = params
        self.staging = staging
        self.progress = progress
        self.crypto = crypto
        self.packs: list[str] = []
        self.pack_no: dict[str, int] = {}
        self.locs: list[ChunkLoc | None] = []
        self.by_id: dict[bytes, int] = {}
        self.ids: list[bytes] = []  # chunk id by chunk number
        #: work done while waiting for a group's compression; returns False when it has
        #: nothing (left) to do
        self.idle: Callable[[], bool] | None = None
        self.pending: deque[tuple[list[_Job], bytearray, Future[_Encoded]]] = deque()
        self.pool = _shared_pool("compress", max(1, (os.cpu_count() or 1)))
        self.window = 2 * max(1, (os.cpu_count() or 1)) + 2  # groups in flight
        self.group: list[_Job] = []
        #: the open group's chunks back to back, ``group_fill`` bytes of it: each chunk is
        #: copied once, into this. Group buffers are of one size, enough for a group and its
        #: last chunk, and are used again once their group is written (`spare`): no buffer
        #: grows chunk by chunk, nor is new memory taken and faulted in for every group
        self.buf_size = GROUP_BYTES + params.max_size
        self.spare: list[bytearray] = []
        self.group_buf = bytearray()  # taken at the group's first chunk (`_buffer`)
        self.group_fill = 0
        self.pack: PackWriter | None = None
        self.result_new_bytes = 0
        self.new_chunks = 0
        self.reused = 0
        self.written: list[str] = []
        self.uploads: list[Future[None]] = []
        self.upload_pool = _shared_pool("upload", UPLOAD_THREADS)
        self.open_chunks: list[int] = []  # chunk numbers in the pack being written
        self.sha: dict[int, bytes] = {}

    def _pack_index(self, digest: str) -> int:
        n = self.pack_no.get(digest)
        if n is None:
            n = self.pack_no[digest] = len(self.packs)
            self.packs.append(digest)
        return n

    def chunk(self, data: memoryview | bytes | bytearray) -> int:
        """The chunk number of these bytes in this layer's chunk table."""
        cid = chunk_id(data)
        n = self.by_id.get(cid)
        if n is not None:
            return n
        n = len(self.locs)
        self.by_id[cid] = n
        self.ids.append(cid)
        k: KnownChunk | None = self.known.get(cid)
        if k is not None and not self.crypto:
            self.locs.append(ChunkLoc(cid, self._pack_index(k.pack), k.offset, k.clen, k.ulen,
                                      k.codec))
            self.reused += 1
            return n
        if self.claims is not None:
            owner = self.claims.setdefault(cid, (self, n))
            if owner[0] is not self:
                self.locs.append(None)
                self.claimed.append((n, owner[0], owner[1]))
                return n
        self.locs.append(None)
        if self.crypto:
            self.sha[n] = hashlib.sha256(data).digest()
        self.group.append((n, cid, len(data)))
        fill = self.group_fill
        end = fill + len(data)
        if end > len(self.group_buf):
            self._buffer(end)
        self.group_buf[fill:end] = data
        self.group_fill = end
        if end >= GROUP_BYTES or len(self.group) >= GROUP_CHUNKS:
            self._submit()
        return n

    def _buffer(self, need: int) -> None:
        """Room for ``need`` bytes in the open group's buffer: a buffer given back, or a new
        one, at a group's first chunk (once the groups before it have been drained, so
        no more buffers are held than groups in flight); a larger one for a chunk past a
        buffer's room (larger than max_size)."""
        fill = self.group_fill
        if fill == 0 and need <= self.buf_size:
            self.group_buf = self.spare.pop() if self.spare else _BUFFERS.take(self.buf_size)
            return
        grown = bytearray(max(need, self.buf_size))
        grown[:fill] = memoryview(self.group_buf)[:fill]
        self.group_buf = grown

    def _submit(self) -> None:
        if not self.group:
            return
        buf = self.group_buf
        self.pending.append((self.group, buf, self.pool.submit(
            encode_parts, memoryview(buf)[:self.group_fill], [ulen for _, _, ulen in self.group],
            self.params.level)))
        self.group, self.group_fill, self.group_buf = [], 0, bytearray()
        while len(self.pending) >= self.window:
            self._drain_one()

    def _drain_one(self) -> None:
        """Append the oldest group's stored bytes to the open pack, in submission order; a
        pack is sealed after the group that fills it (a group never spans two packs)."""
        jobs, buf, fut = self.pending.popleft()
        while not fut.done() and self.idle is not None and self.idle():
            pass
        parts, rows = fut.result()
        if self.pack is None:
            self.pack = PackWriter(self.staging)
        pcs = self.pack.add_blob(parts, [(cid, codec, off, clen, ulen) for (_, cid, ulen),
                                         (codec, off, clen) in zip(jobs, rows, strict=True)])
        blob_size = sum(len(p) for p in parts)
        del parts
        if len(buf) == self.buf_size:  # its pieces are in the pack: the buffer is free again
            self.spare.append(buf)
        for (n, cid, ulen), pc in zip(jobs, pcs, strict=True):
            self.locs[n] = ChunkLoc(cid, -1, pc.offset, pc.clen, ulen, pc.codec,
                                    self.sha.get(n))
            self.open_chunks.append(n)
            self.new_chunks += 1
        self.result_new_bytes += blob_size
        if self.pack.size >= PACK_TARGET:
            self._seal()

    def _seal(self) -> None:
        if self.pack is None or not len(self.pack):
            return
        fp: FinishedPack = self.pack.finish()
        self.pack = None
        pno = self._pack_index(fp.digest)
        for n in self.open_chunks:
            loc = self.locs[n]
            assert loc is not None
            self.locs[n] = ChunkLoc(loc.chunk_id, pno, loc.offset, loc.clen, loc.ulen,
                                    loc.codec, loc.sha256)
        self.open_chunks = []
        self.written.append(fp.digest)
        if self.defer_uploads:
            self.deferred.append(fp)
            if self.store.local:  # its data on disk now, beside the stream, not at publish
                self.uploads.append(self.upload_pool.submit(_sync_file, fp.path))
        else:
            self.uploads.append(self.upload_pool.submit(self._upload, fp))

    def _upload(self, fp: FinishedPack) -> None:
        try:
            key = object_key("packs", fp.digest)
            if not self.store.has(key):
                self.store.put_file(key, fp.path)
        finally:
            fp.path.unlink(missing_ok=True)

    def finish(self) -> list[ChunkLoc]:
        self.seal_all()
        self.publish()
        assert all(loc is not None for loc in self.locs)
        return self.locs  # type: ignore[return-value]

    def seal_all(self) -> None:
        """Every chunk written into a sealed pack (kept in staging when deferred)."""
        self._submit()
        while self.pending:
            self._drain_one()
        self._seal()
        _BUFFERS.give(self.spare)  # no group is left to fill
        self.spare = []

    def seal_done(self, ok: bool) -> None:
        """Tell the writers that took chunks from this one whether its packs are sound (its
        stream verified and every chunk sealed); one that failed gives its claims up."""
        self.ok = ok
        if not ok and self.claims is not None:
            for cid in self.ids:
                if self.claims.get(cid, (None,))[0] is self:
                    self.claims.pop(cid, None)
        self.sealed.set()

    def take_claimed(self) -> None:
        """Point each chunk another writer claimed first at where that writer stored it,
        once it has sealed; `ClaimLost` when it failed (this layer is then read again)."""
        for n, owner, there in self.claimed:
            owner.sealed.wait()
            loc = owner.locs[there]
            if not owner.ok or loc is None:
                raise ClaimLost("a chunk came from a layer that failed")
            self.locs[n] = ChunkLoc(loc.chunk_id, self._pack_index(owner.packs[loc.pack]),
                                    loc.offset, loc.clen, loc.ulen, loc.codec, loc.sha256)
        self.claimed = []

    def start_publish(self) -> None:
        """Start uploading the deferred packs (`publish` waits for them): the packs of
        several writers go up side by side."""
        self.uploads += [self.upload_pool.submit(self._upload, fp) for fp in self.deferred]
        self.deferred = []

    def publish(self) -> None:
        """Upload the deferred packs and wait for every upload."""
        self.start_publish()
        for f in self.uploads:
            f.result()  # raise the first upload error
        self.published = True

    def abort(self) -> None:
        mine: list[Future[Any]] = [fut for _, _, fut in self.pending]
        mine += self.uploads
        for fut in mine:
            fut.cancel()
        wait(mine)  # what already runs ends before the buffers and staging it reads go
        if self.pack is not None:
            self.pack.abort()
            self.pack = None


def _sync_file(path: Path) -> None:
    """fsync a sealed pack kept in staging: a file store's `put_file` fsyncs it again
    before it becomes visible, and then finds nothing left to write. A pack already
    published (and synced there) or discarded is gone: nothing to do."""
    fsync_path(path, missing_ok=True)


#: files per batch read, and the batches read ahead of the chunker
READ_BATCH_FILES = 256
READ_BATCH_BYTES = 8 << 20
READ_AHEAD = 4


def _batches(items: list[Scanned]) -> Iterator[list[Scanned]]:
    batch: list[Scanned] = []
    nbytes = 0
    for s in items:
        if s.entry.type != "reg" or s.source is None:
            continue
        batch.append(s)
        nbytes += s.entry.size
        if len(batch) >= READ_BATCH_FILES or nbytes >= READ_BATCH_BYTES:
            yield batch
            batch, nbytes = [], 0
    if batch:
        yield batch


class _ReadAhead:
    """Reads the regular files' bytes in batches on a thread of its own, a few batches ahead
    of the chunker: the batched reader releases the GIL, so reading overlaps chunking,
    hashing and compression. Yields (size, bytes or None) per file, in order."""

    def __init__(self, items: list[Scanned], limit: int) -> None:
        self._q: queue.Queue[tuple[list[tuple[int, bytes | None]] | None,
                                   BaseException | None]] = queue.Queue(READ_AHEAD)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(items, limit), daemon=True,
                                   name="dsec-read-ahead")
        self._t.start()

    def _run(self, items: list[Scanned], limit: int) -> None:
        try:
            for batch in _batches(items):
                if self._stop.is_set():
                    return
                self._q.put((read_many([s.source for s in batch  # type: ignore[misc]
                                        ], limit), None))
            self._q.put((None, None))
        except BaseException as e:  # handed to the chunker, which raises it
            self._q.put((None, e))

    def __iter__(self) -> Iterator[tuple[int, bytes | None]]:
        while True:
            got, err = self._q.get()
            if err is not None:
                raise err
            if got is None:
                return
            yield from got

    def close(self) -> None:
        self._stop.set()
        while self._t.is_alive():  # unblock a put into a full queue
            try:
                self._q.get(timeout=0.1)
            except queue.Empty:
                pass
        self._t.join()


class _Batcher:
    """Small files grouped into batch chunks in the order given (path order), with
    content-defined batch boundaries so that a small change stays local."""

    def __init__(self, w: _Writer, params: ChunkParams) -> None:
        self.w = w
        self.params = params
        self.batch = bytearray()
        self.files: list[tuple[Entry, int, int]] = []

    def add(self, e: Entry, data: bytes) -> None:
        self.files.append((e, len(self.batch), len(data)))
        self.batch.extend(data)
        cut_here = xxhash.xxh3_64_intdigest(data) & 3 == 0
        if len(self.batch) >= self.params.avg_size or (len(self.batch) >= self.params.min_size
                                                       and cut_here):
            self.flush()

    def flush(self) -> None:
        if not self.files:
            return
        n = self.w.chunk(self.batch)  # copied into the group as it is taken
        for e, off, ln in self.files:
            e.chunks = [(n, off, ln)]
        self.batch.clear()
        self.files.clear()


def chunk_stream(w: _Writer, read: Callable[[int], bytes | memoryview], size: int,
                 params: ChunkParams) -> list[tuple[int, int, int]]:
    """The chunks of one file of ``size`` bytes (at least ``params.small_file``) read from a
    stream, cut exactly as `write_layer` cuts the same file read whole, holding one window
    of ``16 * max_size`` bytes: a content-defined boundary depends only on the bytes since
    the previous one, so every chunk but the last of a window is final, and that one is cut
    again at the start of the next. ``read(n)`` may return fewer than ``n`` bytes (a view of
    whatever piece of the stream holds them: each is copied once, into the window, a buffer
    used again stream after stream)."""
    def exact(n: int) -> bytes | memoryview:
        data = read(n)
        if len(data) < n:
            parts = [data]
            got = len(data)
            while got < n and (piece := read(n - got)):
                parts.append(piece)
                got += len(piece)
            data = b"".join(parts)
        if len(data) < n:
            raise BuildError(f"stream ended {n - len(data)} bytes before the file's end")
        return data

    if size <= params.max_size:
        return [(w.chunk(exact(size)), 0, size)]
    win = _BUFFERS.take(16 * params.max_size)
    window = len(win)
    mv = memoryview(win)
    out: list[tuple[int, int, int]] = []
    fill = 0  # the window's bytes: the last window's uncut end, then what was read after it
    left = size
    try:
        while left or fill:
            while left and fill < window:
                piece = read(min(left, window - fill))
                if not piece:
                    raise BuildError(f"stream ended {left} bytes before the file's end")
                mv[fill:fill + len(piece)] = piece
                fill += len(piece)
                left -= len(piece)
            view = mv[:fill]
            cuts = list(cut(view, params))
            if left:
                cuts = cuts[:-1]  # the window's last chunk may end early: cut it again
            done = 0
            for o, ln in cuts:  # each chunk is copied into its group (`_Writer.chunk`)
                out.append((w.chunk(view[o:o + ln]), 0, ln))
                done = o + ln
            view.release()
            if not left and done < fill:  # pragma: no cover - cut always covers the rest
                raise BuildError("chunker left bytes uncut")
            rest = fill - done  # at most one chunk: moved to the window's start
            mv[:rest] = bytes(mv[done:fill])
            fill = rest
    finally:
        mv.release()
        _BUFFERS.give([win])
    return out


def canonical_entries(scanned: list[Scanned], mtime: int = 0) -> list[Scanned]:
    """Sorted, with the root and every parent directory present and each hardlink group
    named by its first path. Every path's xattrs are what a layer may hold
    (`validate.layer_xattrs`), whichever source they came from."""
    items: dict[str, Scanned] = {}
    for s in scanned:
        if s.entry.xattrs:
            s.entry.xattrs = layer_xattrs(s.entry.xattrs, s.source or repr(s.entry.path))
        items[s.entry.path] = s
    if "." not in items:
        items["."] = Scanned(Entry(".", "dir", 0o755, mtime=mtime), None)
    for path in list(items):
        p = path
        while p != ".":
            p = parent_of(p)
            if p in items:
                break
            items[p] = Scanned(Entry(p, "dir", 0o755, mtime=mtime), None)
    # a hardlink group's content lives at the group's first path in sorted order
    groups: dict[str, list[str]] = {}
    for path, s in items.items():
        if s.entry.type == "hard":
            root = s.entry.target
            while root in items and items[root].entry.type == "hard":
                root = items[root].entry.target
            groups.setdefault(root, []).append(path)
    for root, links in groups.items():
        if root not in items or items[root].entry.type != "reg":
            raise BuildError(f"hardlink {links[0]!r} points at {root!r}, which is not a file")
        first = min([root, *links])
        if first != root:
            src = items[root]
            items[first] = Scanned(_renamed(src.entry, first), src.source)
            items[root] = Scanned(Entry(root, "hard", target=first), None)
        for p in [root, *links]:
            if p != first:
                items[p] = Scanned(Entry(p, "hard", target=first), None)
    return [items[k] for k in sorted(items)]


def _renamed(e: Entry, path: str) -> Entry:
    return replace(e, path=path)


def _cut_large(w: _Writer, e: Entry, source: str, params: ChunkParams) -> int:
    """Chunk a file larger than one chunk at content-defined boundaries; returns its size."""
    fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                e.chunks = [(w.chunk(view[o:o + ln]), 0, ln) for o, ln in cut(view, params)]
            finally:
                view.release()
        return size
    finally:
        os.close(fd)


class _IndexJson:
    """Serializes the index entries the writer is done with (their chunks all numbered)
    while it waits for compression, a slice at a time on the calling thread, so that the
    index is mostly written when the last chunk is (format/index.py `EntryJson`)."""

    SLICE = 512

    def __init__(self, entries: list[Entry], ids: list[bytes]) -> None:
        self.entries = entries
        self.json = EntryJson(ids)
        self.done = 0  # entries serialized
        self.final = 0  # entries whose chunks are all known: entries[:final]

    def step(self) -> bool:
        upto = min(self.final, self.done + self.SLICE)
        if upto <= self.done:
            return False
        self.json.add(self.entries[self.done:upto])
        self.done = upto
        return True

    def arrays(self) -> tuple[bytes, bytes]:
        self.final = len(self.entries)
        while self.step():
            pass
        return self.json.arrays()


def write_layer(store: Store, scanned: list[Scanned], *, known: KnownChunks,
                params: ChunkParams | None = None, progress: Progress | None = None,
                crypto_digests: bool = False) -> tuple[LayerIndex, WriteStats]:
    """Chunk, compress and pack the entries' bytes into the store; return the index.

    The caller puts the index and manifest and writes the ref (see `layer_manifest`)."""
    params = params or ChunkParams()
    staging = Path(tempfile.mkdtemp(prefix="layer-", dir=store.staging_dir()))
    w = _Writer(store, known, params, staging, progress, crypto_digests)
    entries: list[Entry] = []
    batcher = _Batcher(w, params)

    items = canonical_entries(scanned)
    reads = _ReadAhead(items, params.max_size)
    contents = iter(reads)
    ij = _IndexJson(entries, w.ids)
    w.idle = ij.step
    held = 0  # the first entry waiting in the batcher for its batch chunk
    try:
        for s in items:
            ij.final = held if batcher.files else len(entries)
            e = s.entry
            entries.append(e)
            if progress:
                progress("files", 1)
            if e.type != "reg" or s.source is None:
                continue
            size, data = next(contents)
            e.size = size
            if size == 0:
                continue
            if data is None:  # larger than one chunk: cut from a map of the file
                size = e.size = _cut_large(w, e, s.source, params)
            elif size < params.small_file:
                if not batcher.files:
                    held = len(entries) - 1
                batcher.add(e, data)
            else:
                e.chunks = [(w.chunk(data), 0, len(data))]
            if progress:
                progress("bytes", size)
        batcher.flush()
        locs = w.finish()
    except BaseException:
        w.abort()
        raise
    finally:
        reads.close()
        remove_tree(staging)
    index = LayerIndex(entries=entries, chunks=locs, packs=w.packs, params=params,
                       entry_json=ij.arrays())
    return index, WriteStats(w.new_chunks, w.result_new_bytes, w.reused, w.written)


def layer_manifest(store: Store, index: LayerIndex, *, name: str, version: str,
                   spec_digest: str = "", base: list[str] | None = None,
                   env: dict[str, str] | None = None, workdir: str = "",
                   created_by: str = "dsec build") -> tuple[str, Manifest]:
    """Put the index and the layer's manifest; return the manifest digest."""
    index_digest = put_index(store, index)
    used_packs = sorted({index.packs[c.pack] for c in index.chunks})
    m = Manifest(
        kind="layer", name=name, version=version, content_digest=index.content_digest(),
        index=index_digest, packs=used_packs, base=base or [], spec_digest=spec_digest,
        env=env or {}, workdir=workdir, created_by=created_by,
        size=sum(e.size for e in index.entries if e.type == "reg"),
        stored_size=index.stored_bytes(),
        files=sum(1 for e in index.entries if e.type != "dir"),
    )
    return put_manifest(store, m), m


def build_layer_from_dir(store: Store, upper_dir: Path, name: str, version: str, *,
                         base: list[str] | None = None, env: dict[str, str] | None = None,
                         workdir: str = "", created_by: str = "dsec snapshot",
                         known: KnownChunks | None = None,
                         snapshot: ScanReport | None = None, replace: bool = False
                         ) -> tuple[str, Manifest]:
    """Turn a directory in overlayfs upper form into a layer and point ``name@version`` at
    it. The directory is scanned without following a link.

    With ``snapshot`` the directory is a sandbox's writable diff, written by whatever ran in
    the sandbox: `SNAPSHOT_POLICY` applies, and what it dropped or changed is logged and
    recorded in the report."""
    if known is None:
        known = KnownChunks.load(store, Path(load_config().data_dir) / "chunk-tables")
    scanned = scan_dir(upper_dir, overlay_upper=True, snapshot=snapshot)
    for w in snapshot.warnings() if snapshot is not None else []:
        log.warning("snapshot of %s: %s", upper_dir, w)
    index, _ = write_layer(store, scanned, known=known)
    digest, m = layer_manifest(store, index, name=name, version=version, base=base, env=env,
                               workdir=workdir, created_by=created_by)
    commit_ref(store, name, version, digest, replace=replace, verb=f"this {created_by} made")
    return digest, m
