"""OCI and Docker images into dsec: each image layer becomes a dsec layer, the image config
a dsec image.

A layer is read as one stream: blob -> sha256 (the manifest's digest) -> gzip or zstd
(sniffed) -> sha256 (the config's uncompressed ``diff_id``) -> tar members. Files of at
least ``small_file`` bytes are chunked as the stream reaches them (one window of chunks in
memory); smaller ones wait in a spool (in memory, a bytes object each, up to `SPOOL_MEMORY`,
then in a file in staging) until the end of the layer, because they are grouped
into batch chunks in path order, exactly as `dsec build` groups them, so an image imported,
exported and imported again has the same content digests. Packs stay in staging until both
digests match: a layer whose bytes do not match is refused, naming the digest, and the
store is unchanged.

Member names go through the same checks as `extract` steps (`build/tarball.py`): ``..``,
absolute paths, hardlinks to outside, members below a symlink and relative symlinks climbing
out are refused; device nodes are dropped (0:0 character devices are whiteouts); ``.wh.``
files and opaque markers become whiteouts and opaque directories. Each layer is named
``oci-layer@<diff_id hex>``, so a layer already imported is not read again.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import platform as _platform
import queue
import re
import shutil
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from ..core.errors import (
    DsecError,
    IntegrityError,
    NotFoundError,
    RefConflictError,
    SpecError,
    UsageError,
)
from ..core.gcpause import gc_paused
from ..format.index import ChunkParams, Entry, LayerIndex
from ..format.manifest import Manifest, load_manifest
from ..format.refs import commit_ref, get_ref, set_ref
from ..format.validate import MAX_TEXT, layer_count_problem
from ..push import retry
from ..push.dedup import KnownChunks, cache_table
from ..push.ocisource import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    Descriptor,
    Source,
    load_doc,
    open_source,
)
from ..push.stores.base import Store
from .image import write_image
from .layer import (
    ClaimLost,
    Claims,
    _Batcher,
    _Writer,
    canonical_entries,
    chunk_stream,
    layer_manifest,
)
from .tarball import MAX_SPARSE_SIZE, scan_members
from .tarhdr import StreamTarFile, tarinfo_class

log = logging.getLogger(__name__)

LAYER_NAME = "oci-layer"
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar", "",
}
GZIP_MAGIC = b"\x1f\x8b"
#: a layer's small files wait in memory up to this many bytes, then in a staging file
SPOOL_MEMORY = 64 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: the most the env, workdir and annotations taken from an image config may weigh in all
MAX_SETTINGS = 1 << 20
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")
#: layers read at the same time (each on its own read-ahead thread and compression pool):
#: enough to overlap one layer's download and verification with another's chunking
RUN_LAYER_WORKERS = max(2, min(6, 2 * (os.cpu_count() or 1)))
#: a layer read while this many others are read is read lean (`stage_layer`): a layer read
#: on four threads keeps about two cores busy (its inflate beside its parser). While a run
#: of several images is still being planned, every layer is read lean: more are coming
LEAN_BESIDE = max(1, (os.cpu_count() or 1) // 2)
#: how imported layers are cut and stored: the build's chunking, zstd at level 1. An import
#: is a conversion on the way to a sandbox (`from: [oci:...]` waits for it), its new bytes
#: are mostly one base image's, and zstd is the largest part of its CPU after the inflate:
#: level 1 compresses a Python tree's 1 MiB groups about 1.4x as fast as level 3 for about
#: a tenth more stored bytes (docs/oci.md, "Measured")
IMPORT_PARAMS = ChunkParams(level=1)
_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass
class ImportProgress:
    """What the transfer commands render: layers done of all, bytes read of all."""

    objects_done: int = 0
    objects_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass
class ImportedLayer:
    ref: str
    manifest: str
    content_digest: str
    diff_id: str
    digest: str  # the blob's digest in the source ("" for a docker save layer)
    size: int
    stored_size: int
    reused: bool
    new_bytes: int = 0


@dataclass
class ImportReport:
    source: str
    ref: str
    manifest: str  # the dsec image manifest digest
    source_digest: str  # the OCI manifest digest the image was read from
    platform: str
    layers: list[ImportedLayer] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- streams ----------------------------------------------------------------------------------
class _HashBehind:
    """sha256 on a thread of its own, fed the pieces a reader passes on: hashing the
    uncompressed layer (about a third of inflating it) is taken off the inflating thread,
    which a layer's read waits for. At most ``depth`` pieces wait; the pieces are immutable
    bytes, so nothing is copied."""

    def __init__(self, depth: int = 16) -> None:
        self.q: queue.Queue[bytes | memoryview | None] = queue.Queue(depth)
        self.h = hashlib.sha256()
        self.t = threading.Thread(target=self._run, name="oci-layer-hash", daemon=True)
        self.t.start()
        self.closed = False

    def _run(self) -> None:
        while (piece := self.q.get()) is not None:
            self.h.update(piece)

    def update(self, piece: bytes) -> None:
        self.q.put(piece)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.q.put(None)
            self.t.join()

    def hexdigest(self) -> str:
        self.close()
        return self.h.hexdigest()


class _Hashed:
    """A reader that hashes and counts what passes; with ``limit`` it never reads past one
    byte beyond it, so an over-long blob is seen without being read whole. ``h`` is the
    hash (sha256 in this thread by default, or a `_HashBehind`)."""

    def __init__(self, f: Any, limit: int | None = None,
                 tick: Callable[[int], None] | None = None, h: Any = None) -> None:
        self.f = f
        self.h: Any = h if h is not None else hashlib.sha256()
        self.n = 0
        self.limit = limit
        self.tick = tick
        self.head = b""

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 20
        if self.head:
            first, self.head = self.head[:n], self.head[n:]
            return first
        if self.limit is not None:
            n = min(n, self.limit + 1 - self.n)
            if n <= 0:
                return b""
        data: bytes = self.f.read(n)
        self.h.update(data)
        self.n += len(data)
        if self.tick and data:
            self.tick(len(data))
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer at the end), left to be read again."""
        head = self.head
        self.head = b""
        while len(head) < n:
            piece = self.read(n - len(head))
            if not piece:
                break
            head += piece
        self.head = head
        return head[:n]

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


class _NoHash:
    def update(self, data: bytes) -> None:
        pass


_NO_HASH = _NoHash()


class _Prefetch:
    """Reads a stream on a thread, a bounded queue of pieces ahead of the consumer: the
    thread decompresses and hashes (isal, zstd and sha256 release the GIL) while the caller
    parses, chunks and compresses, so the two overlap on two cores. At most ``depth`` pieces
    wait.

    To the tar reader it is a file that only goes forward: ``read(n)`` returns ``n`` bytes
    unless the stream ends, ``seek`` skips ahead (what tarfile's random-access mode does
    between members) and refuses to go back, so the archive is still read once, as a stream,
    without the per-record copies of tarfile's stream mode.

    Without ``thread`` the pieces are read by the caller as it needs them (a layer read
    lean: the stages then take turns on one thread)."""

    PIECE = 1 << 20

    def __init__(self, f: Any, depth: int = 8, name: str = "oci-layer-read",
                 thread: bool = True) -> None:
        self.f = f
        self.q: queue.Queue[bytes | BaseException] = queue.Queue(depth)
        self.stop = threading.Event()
        self.buf = memoryview(b"")
        self.piece = b""  # what ``buf`` is a view of
        self.eof = False
        self.pos = 0
        self.t: threading.Thread | None = None
        if thread:
            self.t = threading.Thread(target=self._run, name=name, daemon=True)
            self.t.start()

    def _put(self, item: bytes | BaseException) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                data = self.f.read(self.PIECE)
                if not self._put(data) or not data:
                    return
        except BaseException as e:  # handed to the reader, raised there
            self._put(e)

    def _fill(self) -> bool:
        """The next piece in ``buf``; False at the end of the stream."""
        while not self.buf and not self.eof:
            item = self.q.get() if self.t is not None else self.f.read(self.PIECE)
            if isinstance(item, BaseException):
                self.eof = True
                raise item
            if not item:
                self.eof = True
            self.piece = item
            self.buf = memoryview(item)
        return bool(self.buf)

    def read(self, n: int = -1, view: bool = False) -> bytes:
        """``n`` bytes (fewer at the end); with ``view``, bytes held by one piece come as a
        read-only view of it, not a copy (a member's data on its way to the chunker)."""
        if n is None or n < 0:
            n = self.PIECE
        if not self._fill():
            return b""
        if len(self.buf) == n == len(self.piece):  # a whole piece: no copy
            out = self.piece
            self.buf = memoryview(b"")
        elif len(self.buf) >= n:  # the common case: one piece holds it
            out = self.buf[:n] if view else bytes(self.buf[:n])  # type: ignore[assignment]
            self.buf = self.buf[n:]
        else:
            parts = []
            left = n
            while left and self._fill():
                parts.append(self.buf[:left])
                left -= len(parts[-1])
                self.buf = self.buf[len(parts[-1]):]
            out = b"".join(parts)
        self.pos += len(out)
        return out

    def read_some(self, n: int) -> bytes | memoryview:
        """Up to ``n`` bytes, as a read-only view of the one piece that holds them (``b""``
        at the end): what a reader that copies them anyway takes, without joining pieces."""
        if not self._fill():
            return b""
        out = self.buf[:n]
        self.skip(len(out))
        return out

    def block(self, n: int) -> memoryview | None:
        """The next ``n`` bytes as a view of the piece holding them, not taken; None where
        they run past the piece (or the stream). `skip` takes them."""
        if not self._fill() or len(self.buf) < n:
            return None
        return self.buf[:n]

    def skip(self, n: int) -> None:
        """Take ``n`` bytes the current piece holds."""
        self.buf = self.buf[n:]
        self.pos += n

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < self.pos:
            raise tarfile.StreamError("the layer stream cannot go back (a member's data "
                                      "read out of order)")
        while self.pos < offset and self._fill():
            step = min(offset - self.pos, len(self.buf))
            self.buf = self.buf[step:]
            self.pos += step
        return self.pos

    def drain(self) -> None:
        while self._fill():
            self.buf = memoryview(b"")
        if self.t is not None:
            self.t.join()

    def close(self) -> None:
        self.stop.set()
        if self.t is not None:
            self.t.join()


class _Inflate:
    """A gzip stream (one member or several, back to back) inflated with ISA-L from large
    pieces of the blob. ISA-L's own streaming decompressor is used, not its zlib-style
    ``decompressobj``: the latter holds the GIL while it inflates, so the layer threads'
    parsing and the inflate took turns instead of running side by side (docs/oci.md,
    "Measured"). Each member's header, CRC and length are checked by ISA-L; bytes after a
    member that do not start another are an error, as in `gzip`. ``read(n)`` returns at most
    ``n`` bytes (``OUT`` without ``n``) whatever the compression ratio (a gzip bomb is read
    piecewise)."""

    PIECE = 1 << 20
    OUT = 4 << 20

    def __init__(self, raw: _Hashed) -> None:
        from isal import igzip_lib  # ISA-L's inflate: about 3x zlib's (docs/oci.md)

        self.raw = raw
        self.new = lambda: igzip_lib.IgzipDecompressor(flag=igzip_lib.DECOMP_GZIP)
        self.d = self.new()

    def read(self, n: int = -1) -> bytes:
        limit = n if 0 < n < self.OUT else self.OUT
        while True:
            d = self.d
            if d.eof:
                data = d.unused_data or self.raw.read(self.PIECE)
                if not data:
                    return b""  # the stream ends where a member ends
                self.d = d = self.new()
            elif d.needs_input:
                data = self.raw.read(self.PIECE)
                if not data:
                    raise EOFError("the gzip stream ends inside a member")
            else:  # output left from the input already given
                data = b""
            out: bytes = d.decompress(data, limit)
            if out:
                return out


def _decompressed(raw: _Hashed) -> IO[bytes]:
    head = raw.peek(4)
    if head[:2] == GZIP_MAGIC:
        return _Inflate(raw)  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(  # type: ignore[return-value]
            raw, read_size=_Inflate.PIECE, read_across_frames=True)  # type: ignore[arg-type]
    return raw  # type: ignore[return-value]


# -- one layer --------------------------------------------------------------------------------
class _Spool:
    """A layer's small files' bytes until its end: in memory, one bytes object per file, up
    to `SPOOL_MEMORY` bytes, then in a file in staging. `add` returns where a file's bytes
    went: (-1, its number in memory) or (-2, its offset in the file); `get` reads them."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.mem: list[bytes] = []
        self.held = 0
        self.file: IO[bytes] | None = None
        self.end = 0

    def add(self, data: bytes | memoryview) -> tuple[int, int]:
        if self.file is None and self.held + len(data) <= SPOOL_MEMORY:
            self.mem.append(bytes(data))
            self.held += len(data)
            return -1, len(self.mem) - 1
        if self.file is None:
            self.file = tempfile.TemporaryFile(dir=self.staging)
        self.file.write(data)
        self.end += len(data)
        return -2, self.end - len(data)

    def get(self, where: int, at: int, length: int) -> bytes:
        if where == -1:
            return self.mem[at]
        assert self.file is not None
        self.file.seek(at)
        return self.file.read(length)

    def close(self) -> None:
        self.mem = []
        if self.file is not None:
            self.file.close()


def _scan_layer(tf: tarfile.TarFile, ahead: _Prefetch, label: str, w: _Writer,
                params: ChunkParams, spool: _Spool) -> list[Entry]:
    def exact(n: int) -> bytes:
        data = ahead.read(n, view=True)
        if len(data) < n:
            raise tarfile.ReadError("unexpected end of data")
        return data

    def some(n: int) -> bytes | memoryview:
        data = ahead.read_some(n)
        if not data:
            raise tarfile.ReadError("unexpected end of data")
        return data

    def on_file(tf: tarfile.TarFile, m: tarfile.TarInfo, e: Entry) -> None:
        if getattr(m, "sparse", None) and m.size > MAX_SPARSE_SIZE:
            raise SpecError(f"member {m.name!r} is sparse with an apparent size of {m.size} "
                            f"bytes, over the limit of {MAX_SPARSE_SIZE}", path=label)
        if m.size == 0:
            return None
        read: Callable[[int], bytes]
        part: Callable[[int], bytes | memoryview]
        if m.sparse:  # tarfile's reader follows the data map
            f = tf.extractfile(m)
            assert f is not None
            read = part = f.read
        else:  # straight from the stream: one copy fewer than tarfile's file object
            ahead.seek(m.offset_data)
            read, part = exact, some
        if m.size < params.small_file:
            # spooled until path order is known: a negative chunk number marks where
            data = read(m.size)
            e.chunks = [(*spool.add(data), len(data))]
        else:
            e.chunks = chunk_stream(w, part, m.size, params)
        return None

    scanned = scan_members(tf, Path(label), "", on_file, devices=False)
    entries = [s.entry for s in canonical_entries(list(scanned.values()))]
    batcher = _Batcher(w, params)
    for e in entries:
        if e.type == "reg" and e.chunks and e.chunks[0][0] < 0:
            batcher.add(e, spool.get(*e.chunks[0]))
    batcher.flush()
    return entries


@dataclass
class StagedLayer:
    """A layer read and verified, its packs still in staging: nothing is in the store
    until `publish`, so an image with one bad layer leaves the store unchanged."""

    w: _Writer
    staging: Path
    index: LayerIndex
    version: str
    diff_id: str
    digest: str

    published: tuple[str, Manifest] | None = None  # its manifest digest and manifest

    def publish(self, store: Store, tables: Path | None = None) -> ImportedLayer:
        """Packs, index, manifest, then the ref; with ``tables``, the chunk table is kept
        there too (`push.dedup`), so the next import does not read the index back. The
        staging directory is left for `discard` (or the caller) to remove."""
        try:
            self.w.publish()  # the packs, before anything that names them
        finally:
            self.w.abort()
        digest, m = layer_manifest(store, self.index, name=LAYER_NAME, version=self.version,
                                   created_by=f"dsec import {self.digest or self.diff_id}")
        set_ref(store, LAYER_NAME, self.version, digest)
        self.published = (digest, m)
        if tables is not None and m.index:
            cache_table(tables, m.index, self.index)
        return ImportedLayer(m.ref, digest, m.content_digest, self.diff_id, self.digest,
                             m.size, m.stored_size, False, self.w.result_new_bytes)

    def discard(self) -> None:
        self.w.abort()
        shutil.rmtree(self.staging, ignore_errors=True)


def _remove_dirs(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def stage_layer(store: Store, source: Source, desc: Descriptor, diff_id: str, *,
                known: KnownChunks, params: ChunkParams | None = None,
                tick: Callable[[int], None] | None = None, claims: Claims | None = None,
                writers: list[tuple[_Writer, Path]] | None = None,
                lean: bool = False) -> StagedLayer:
    """Read one layer blob, verify both digests, and cut it into packs kept in staging.

    With ``claims`` (shared by the layers of a run), a chunk another layer met first is
    taken from that layer's packs; ``writers`` then lists this layer's writer and staging,
    which the run removes once it has published what it needs (another layer's index may
    name these packs even if this layer fails later on). ``lean`` reads the layer on one
    thread instead of four (`_LayerReader`): the blob is fetched, hashed, inflated, hashed
    again and parsed by the layer's own thread, piece by piece as the parser needs them."""
    params = params or IMPORT_PARAMS
    label = f"layer {desc.digest or diff_id} of {source.label}"
    staging = Path(tempfile.mkdtemp(prefix="import-", dir=store.staging_dir()))
    w = _Writer(store, known, params, staging, None, False, defer_uploads=True,
                claims=claims)
    if writers is not None:
        writers.append((w, staging))
    try:
        spool = _Spool(staging)
        with source.blob(desc) as f, contextlib.closing(spool):
            # four threads per layer: the blob's bytes come in (a registry's are waited
            # for) and are hashed on one, inflated on a second, the inflated bytes hashed
            # on a third, parsed and chunked here; lean, all on this one
            raw = _Hashed(f, desc.size if desc.digest else None, tick)
            fetched: _Hashed | _Prefetch = raw if lean else _Prefetch(
                raw, depth=2, name="oci-blob-read")
            head = _Hashed(fetched, h=_NO_HASH)  # only to sniff the compression
            plain = _Hashed(None, h=hashlib.sha256() if lean else _HashBehind())
            ahead = None
            try:
                plain.f = _decompressed(head)
                ahead = _Prefetch(plain, thread=not lean)
                with StreamTarFile.open(fileobj=ahead, mode="r:",  # type: ignore[call-overload]
                                        tarinfo=tarinfo_class()) as tf:
                    entries = _scan_layer(tf, ahead, label, w, params, spool)
                ahead.drain()  # the end-of-archive padding is part of the diff_id
                head.drain()
                fetched.drain()  # the fetch thread has hashed the last byte
            except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise IntegrityError(f"{label}: cannot read it as a tar stream: {e}") from None
            except Exception as e:  # zstandard's and isal's errors derive from Exception
                if type(e).__name__ not in ("ZstdError", "IsalError"):
                    raise
                raise IntegrityError(f"{label}: cannot decompress it: {e}") from None
            finally:
                if ahead is not None:
                    ahead.close()
                if isinstance(fetched, _Prefetch):
                    fetched.close()
                if isinstance(plain.h, _HashBehind):
                    plain.h.close()
        if desc.digest is not None:
            if raw.n != desc.size:
                got = f"over {desc.size}" if raw.n > desc.size else str(raw.n)
                raise IntegrityError(f"{label}: the blob is {got} bytes, the manifest says "
                                     f"{desc.size}; refused")
            if raw.digest != desc.digest:
                raise IntegrityError(f"{label}: the blob's bytes hash to {raw.digest}, not "
                                     f"{desc.digest}; refused")
        if plain.digest != diff_id:
            raise IntegrityError(f"{label}: the uncompressed layer hashes to {plain.digest}, "
                                 f"not its diff_id {diff_id}; refused")
        w.seal_all()
        w.seal_done(True)  # verified and sealed: other layers may take its chunks now
        w.take_claimed()
    except BaseException:
        if not w.ok:  # nothing can name its packs: gone now
            w.seal_done(False)
            w.abort()
            shutil.rmtree(staging, ignore_errors=True)
        raise
    assert all(loc is not None for loc in w.locs)
    index = LayerIndex(entries=entries, chunks=list(w.locs),  # type: ignore[arg-type]
                       packs=w.packs, params=params)
    index.to_bytes()  # serialized here, beside the other layers, not at publish
    known.add_index(index)  # later layers of the import reuse its chunks
    return StagedLayer(w, staging, index, diff_id.removeprefix("sha256:"), diff_id,
                       desc.digest or "")


def _existing_layer(store: Store, diff_id: str) -> tuple[str, Manifest] | None:
    try:
        digest = get_ref(store, f"{LAYER_NAME}@{diff_id.removeprefix('sha256:')}").manifest
        return digest, load_manifest(store, digest)
    except NotFoundError:
        return None


# -- the image --------------------------------------------------------------------------------
def host_platform() -> str:
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(
        _platform.machine(), _platform.machine())
    return f"linux/{arch}"


def _pick_platform(index: dict[str, Any], want: str, label: str) -> Descriptor:
    items = index.get("manifests")
    if not isinstance(items, list) or not items:
        raise IntegrityError(f"{label}: the image index lists no manifest")
    os_, _, rest = want.partition("/")
    arch, _, variant = rest.partition("/")
    seen = []
    for n, m in enumerate(items):
        desc = Descriptor.parse(m, f"{label}: index entry {n}")
        p = m.get("platform") if isinstance(m, dict) else None
        if not isinstance(p, dict):
            if len(items) == 1:
                return desc
            continue
        have = f"{p.get('os')}/{p.get('architecture')}" + (
            f"/{p['variant']}" if p.get("variant") else "")
        seen.append(have)
        if p.get("os") == os_ and p.get("architecture") == arch and (
                not variant or p.get("variant") == variant):
            return desc
    if not seen:
        raise UsageError(f"{label} lists {len(items)} images and no platforms",
                         hint="name one by its tag (SOURCE:TAG)")
    raise NotFoundError(f"{label} has no image for platform {want}",
                        hint=f"it has: {', '.join(seen)}; choose with --platform")


def _layers_of(doc: dict[str, Any], label: str) -> tuple[Descriptor, list[Descriptor]]:
    if doc.get("mediaType") == "docker-archive":  # synthesized by the archive source
        cfg = doc["config"]
        return (Descriptor("", cfg["digest"], cfg["size"]),
                [Descriptor("", None, 0, path=x["path"]) for x in doc["layers"]])
    if doc.get("schemaVersion") != 2:
        raise UsageError(f"{label}: manifest schema version {doc.get('schemaVersion')!r} is not "
                         "supported (Docker schema 2 and OCI manifests are)")
    config = Descriptor.parse(doc.get("config"), f"{label}: config descriptor")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise IntegrityError(f"{label}: the manifest has no layer list")
    out = [Descriptor.parse(x, f"{label}: layer {n}") for n, x in enumerate(layers)]
    for d in out:
        if d.media_type not in LAYER_TYPES:
            raise UsageError(f"{label}: layer {d.digest} has media type {d.media_type!r}, "
                             "which dsec does not import (tar, tar+gzip, tar+zstd)")
    return config, out


def _str_list(v: Any) -> list[str] | None:
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    return None


def image_settings(config: dict[str, Any], label: str) -> tuple[dict[str, str], str,
                                                                dict[str, str]]:
    """env, workdir, and the rest (user, entrypoint, cmd, labels) as annotations."""
    c = config.get("config") or {}
    if not isinstance(c, dict):
        raise IntegrityError(f"{label}: the image config's 'config' is not an object")
    env: dict[str, str] = {}
    for item in _str_list(c.get("Env")) or []:
        k, sep, v = item.partition("=")
        if sep and k and "\x00" not in item:
            env[k] = v
    workdir = c.get("WorkingDir") if isinstance(c.get("WorkingDir"), str) else ""
    ann: dict[str, str] = {}
    if isinstance(c.get("User"), str) and c["User"]:
        ann["oci.user"] = c["User"]
    for key, name in (("Entrypoint", "oci.entrypoint"), ("Cmd", "oci.cmd")):
        items = _str_list(c.get(key))
        if items is not None:
            ann[name] = json.dumps(items)
    labels = c.get("Labels")
    if isinstance(labels, dict):
        for k, v in labels.items():
            if isinstance(v, str) and k:
                ann[f"oci.label.{k}"] = v
    if isinstance(c.get("StopSignal"), str):
        ann["oci.stop_signal"] = c["StopSignal"]
    ann = {k: v for k, v in ann.items() if "\x00" not in k + v}
    workdir = workdir or ""
    if "\x00" in workdir:
        raise IntegrityError(f"{label}: the image config's WorkingDir holds a NUL byte")
    if workdir and not workdir.startswith("/"):
        workdir = "/" + workdir  # as docker reads a relative WorkingDir
    # what becomes the dsec manifest must stay readable under its bounds
    texts = [workdir, *env, *env.values(), *ann, *ann.values()]
    if any(len(t) > MAX_TEXT for t in texts) or sum(map(len, texts)) > MAX_SETTINGS:
        raise IntegrityError(f"{label}: the image config's env, labels or command are too "
                             f"large (each at most {MAX_TEXT} characters, "
                             f"{MAX_SETTINGS} in all)")
    return env, workdir, ann


def default_name(source: Source) -> tuple[str, str]:
    ref = getattr(source, "ref", None)
    if ref is not None:
        name = ref.repo.rsplit("/", 1)[-1]
        version = ref.tag or (ref.digest.removeprefix("sha256:")[:12] if ref.digest
                              else "latest")
    else:
        path = source.path
        name = path.name.split(".")[0] or "image"
        version = source.reference or "latest"
    return (_SAFE.sub("-", name).strip("-.") or "image")[:128], \
        (_SAFE.sub("-", version).strip("-.") or "latest")[:128]


def import_image(store: Store, source_text: str, *, as_ref: str | None = None,
                 platform: str | None = None, insecure: bool = False,
                 progress: Callable[[ImportProgress], None] | None = None,
                 replace: bool = False) -> ImportReport:
    """Import an image from a registry, an OCI layout or a docker save tarball; write its
    layers and an image manifest, and point ``as_ref`` (or a name taken from the source) at
    it."""
    run = import_images(store, [source_text], as_ref=as_ref, platform=platform,
                        insecure=insecure, progress=progress, replace=replace)
    if run.failed:
        raise run.failed[0][1]
    return run.reports[0]


@dataclass
class ImportRun:
    """What `import_images` did: a report per image imported, the error of each that was
    not (in source order)."""

    reports: list[ImportReport] = field(default_factory=list)
    failed: list[tuple[str, DsecError]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"images": [r.to_dict() for r in self.reports], "seconds": self.seconds,
                "failed": [{"source": s, "error": e.message, "exit_code": e.exit_code}
                           for s, e in self.failed]}


#: images planned, read and published together: each wave's layers are read side by side
#: (sharing chunk claims), then its images are published and its staging removed
WAVE_IMAGES = 16


def import_images(store: Store, sources: list[str], *, as_ref: str | None = None,
                  platform: str | None = None, insecure: bool = False,
                  progress: Callable[[ImportProgress], None] | None = None,
                  replace: bool = False) -> ImportRun:
    """Import a library of images in one run: their manifests are read side by side, each
    distinct layer is read once (by ``diff_id``, whatever image lists it) with up to
    `RUN_LAYER_WORKERS` layers of any image at a time, and a chunk met by two layers being read
    at once is compressed once (the second takes it from the first's packs). Images are
    published in source order, each once all its layers are verified; an image that fails
    (unreadable, a digest mismatch, a name taken) is reported in `ImportRun.failed` and
    changes nothing, and the others are imported all the same. ``as_ref`` names the one
    image of a run of one; ``""`` imports the layers without naming the images (what a
    build's `oci:` dependencies take)."""
    from ..push.lease import WriterLease

    if as_ref and len(sources) != 1:
        raise UsageError("--as names one image: import several sources under the names "
                         "their references give")
    if as_ref:
        from ..core.digests import parse_ref

        parse_ref(as_ref)  # before anything is opened
    t0 = time.monotonic()
    run = ImportRun()
    want = platform or host_platform()
    tables = _chunk_tables()
    prog = ImportProgress()  # one for the run, whatever waves it takes
    with WriterLease(store, "import"), gc_paused():
        known = KnownChunks.load(store, tables)
        for at in range(0, len(sources), WAVE_IMAGES):
            _wave(store, sources[at:at + WAVE_IMAGES], as_ref, want, insecure, replace,
                  (progress, prog), known, tables, run)
    run.seconds = time.monotonic() - t0
    return run


#: what a run reports progress to, and the run's totals so far
_Progress = tuple[Callable[[ImportProgress], None] | None, ImportProgress]


@dataclass
class _Plan:
    """One image of a run: what its manifest and config say, what became of it."""

    source_text: str
    source: Source | None = None
    name: str = ""
    version: str = ""
    top_digest: str = ""
    layers: list[tuple[Descriptor, str]] = field(default_factory=list)  # (blob, diff_id)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    ann: dict[str, str] = field(default_factory=dict)
    report: ImportReport | None = None
    error: DsecError | None = None
    t0: float = 0.0
    as_ref: str | None = None
    replace: bool = False


#: what an image's failure may be besides a DsecError: input that broke a decoder
_INPUT_ERRORS = (OSError, ValueError, KeyError, TypeError)


def _as_dsec_error(e: BaseException, label: str) -> DsecError:
    if isinstance(e, DsecError):
        return e
    if isinstance(e, _INPUT_ERRORS):
        return IntegrityError(f"{label}: {type(e).__name__}: {e}")
    raise e


def _plan(store: Store, source_text: str, as_ref: str | None, want: str, insecure: bool,
          replace: bool) -> _Plan:
    """Open the source, pick the manifest for ``want``, read the config; nothing is written."""
    from ..core.digests import parse_ref

    p = _Plan(source_text, t0=time.monotonic(), as_ref=as_ref, replace=replace)
    label = source_text
    try:
        p.source = source = open_source(source_text, insecure)
        label = source.label
        data, media_type, top_digest = source.root()
        doc = load_doc(data, f"{label}: manifest")
        for _ in range(4):  # an index may name an index (a layout's index.json does)
            media_type = doc.get("mediaType") or media_type
            if media_type not in INDEX_TYPES and (media_type in MANIFEST_TYPES
                                                  or "manifests" not in doc):
                break
            desc = _pick_platform(doc, want, label)
            data = source.manifest(desc)
            doc = load_doc(data, f"{label}: manifest {desc.digest}")
            media_type, top_digest = desc.media_type, desc.digest
        else:
            raise IntegrityError(f"{label}: image indexes nested too deep")
        config_desc, layers = _layers_of(doc, label)
        config = load_doc(source.document(config_desc), f"{label}: image config")
        rootfs = config.get("rootfs") if isinstance(config.get("rootfs"), dict) else {}
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or not all(
                isinstance(d, str) and _DIGEST.match(d) for d in diff_ids):
            raise IntegrityError(f"{label}: the config's rootfs.diff_ids do not list "
                                 f"one sha256 digest per layer ({len(layers)} layers)")
        p.env, p.workdir, p.ann = image_settings(config, label)
        p.name, p.version = parse_ref(as_ref) if as_ref else default_name(source)
        problem = layer_count_problem(len(layers))
        if problem:
            raise UsageError(f"{label} ({p.name}@{p.version}): {problem}")
        p.top_digest = top_digest or ""
        if as_ref != "" and not replace:
            _refuse_other_image(store, p.name, p.version, p.top_digest)
        p.layers = list(zip(layers, diff_ids, strict=True))
        p.report = ImportReport(source_text, f"{p.name}@{p.version}", "", p.top_digest, want)
    except BaseException as e:
        p.error = _as_dsec_error(e, label)
    return p


def _wave(store: Store, sources: list[str], as_ref: str | None, want: str, insecure: bool,
          replace: bool, progress: _Progress,
          known: KnownChunks, tables: Path, run: ImportRun) -> None:
    pool = ThreadPoolExecutor(min(len(sources), 4), thread_name_prefix="oci-plan")
    # each image's layers start as soon as its own manifest and config are read, not once
    # every image's are: from a registry far away that is a round trip or three per image
    planned = [pool.submit(_plan, store, s, as_ref, want, insecure, replace) for s in sources]
    try:
        _read_and_publish(store, planned, progress, known, tables)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        plans = [f.result() for f in planned if not f.cancelled()]
        for p in plans:
            if p.source is not None:
                p.source.close()
    for p in plans:
        if p.error is not None:
            run.failed.append((p.source_text, p.error))
        else:
            assert p.report is not None
            run.reports.append(p.report)


class _Run:
    """The layers of one wave being read: who needs each, what became of it, every writer
    (a pack of one layer may be named by another's index), the progress of the whole."""

    def __init__(self, progress: _Progress, several: bool) -> None:
        self.lock = threading.Lock()
        self.progress, self.prog = progress
        self.needed_by: dict[str, list[_Plan]] = {}
        self.done: dict[str, StagedLayer | ImportedLayer] = {}  # layers read or present
        self.imported: dict[str, ImportedLayer] = {}  # layers published by this run
        self.manifests: dict[str, Manifest] = {}  # the layers' manifests, not read back
        self.settled: dict[str, threading.Event] = {}  # layers being read: set once ended
        self.closing = False
        self.writers: list[tuple[_Writer, Path]] = []
        self.claims: Claims = {}
        self.interrupted: BaseException | None = None
        self.errors: dict[str, DsecError] = {}  # layers that failed, and why
        #: False while images are still being planned: until then a layer no image yet
        #: read wants may still be wanted by the next, so no read is stopped for that
        self.all_planned = False
        self.several = several  # the wave has more than one image

    def plan(self, p: _Plan) -> None:
        """An image joins the run: its layers and bytes count in the totals."""
        if p.error is None:
            with self.lock:
                self.prog.objects_total += len(p.layers)
                self.prog.bytes_total += sum(d.size for d, _ in p.layers)

    def join(self, p: _Plan, diff_id: str) -> bool:
        """``p`` needs a layer an earlier image of the run needs too: True when it is (or
        is being) read for that image; a layer that already failed fails ``p`` now."""
        with self.lock:
            if diff_id not in self.needed_by:
                return False
            self.needed_by[diff_id].append(p)
            if diff_id in self.errors:
                p.error = p.error or self.errors[diff_id]
            return True

    def tick(self, p: _Plan, n: int) -> None:
        with self.lock:
            self.prog.bytes_done += n
            assert p.report is not None
            p.report.bytes_read += n
            if self.progress:
                self.progress(self.prog)

    def skip(self, n: int) -> None:
        """Bytes of a layer not read (in the store, or read for another image)."""
        with self.lock:
            self.prog.bytes_done += n

    def layer_done(self, count: int = 1) -> None:
        with self.lock:
            self.prog.objects_done += count
            if self.progress:
                self.progress(self.prog)

    def wanted(self, diff_id: str) -> bool:
        """False once every image that lists the layer has failed (or the run is being
        given up): its read stops."""
        if self.closing:
            return False
        return not self.all_planned or any(p.error is None for p in self.needed_by[diff_id])

    def fail(self, diff_id: str, e: DsecError) -> None:
        with self.lock:  # with `join`: an image that joins later fails too
            self.errors[diff_id] = e
            for p in self.needed_by[diff_id]:
                p.error = p.error or e
            if diff_id in self.settled:
                self.settled[diff_id].set()


def _read_and_publish(store: Store, planned: list[Future[_Plan]],
                      progress: _Progress, known: KnownChunks,
                      tables: Path) -> None:
    """Read the wave's missing layers, up to `RUN_LAYER_WORKERS` at once, each image's as
    soon as it is planned, while its images are published in source order, each as soon as
    its own layers are verified."""
    r = _Run(progress, several=len(planned) > 1)
    plans: list[_Plan] = []
    pool = ThreadPoolExecutor(RUN_LAYER_WORKERS, thread_name_prefix="oci-import")
    try:
        reader = _LayerReader(store, r, known, pool)
        for fut in planned:
            p = fut.result()
            plans.append(p)
            r.plan(p)
            if p.error is not None:
                continue
            for desc, diff_id in p.layers:
                if r.join(p, diff_id):
                    r.skip(desc.size)
                    r.layer_done()
                    continue
                r.needed_by[diff_id] = [p]
                have = _existing_layer(store, diff_id)  # by diff_id: nothing is downloaded
                if have is not None:
                    d, m = have
                    r.manifests[d] = m
                    r.done[diff_id] = ImportedLayer(m.ref, d, m.content_digest, diff_id,
                                                    desc.digest or "", m.size, m.stored_size,
                                                    True)
                    r.skip(desc.size)
                    r.layer_done()
                else:
                    r.settled[diff_id] = threading.Event()
                    reader.read(p, desc, diff_id, r.claims)
        r.all_planned = True
        at = 0
        while at < len(plans):
            for _, diff_id in plans[at].layers:
                if diff_id in r.settled:
                    r.settled[diff_id].wait()
            # with it, every image after it whose layers have all ended too: layers read side
            # by side end together, and their images are published as one
            end = at + 1
            while end < len(plans) and all(r.settled[d].is_set() for _, d in plans[end].layers
                                           if d in r.settled):
                end += 1
            if r.interrupted is not None:
                raise r.interrupted
            _publish_ready(store, [p for p in plans[at:end] if p.error is None], r, tables)
            at = end
    finally:
        r.closing = True  # layers no image waits for stop at their next piece
        pool.shutdown(wait=True, cancel_futures=True)
        writers = list(r.writers)
        published = {d for w, _ in writers if w.published for d in w.written}
        unpublished = {d for w, _ in writers for d in w.written} - published
        if unpublished:  # later waves must not take chunks from packs now discarded
            known.drop_packs(unpublished)
        for w, _ in writers:
            w.abort()
        _remove_dirs([path for _, path in writers])


class _LayerReader:
    """Reads one layer of a wave on the pool and records what became of it as it ends: a
    failure fails every image that lists the layer (and stops, at their next piece, the
    reads no other image needs); a layer whose claimed chunk came from a layer that failed
    is read again, without claims."""

    def __init__(self, store: Store, r: _Run, known: KnownChunks,
                 pool: ThreadPoolExecutor) -> None:
        self.store, self.r, self.known, self.pool = store, r, known, pool
        self.policy = retry.RetryPolicy.from_env()  # resolved once: it reads the config files
        self.lock = threading.Lock()
        self.reading = 0  # layers being read now

    def read(self, p: _Plan, desc: Descriptor, diff_id: str, claims: Claims | None) -> None:
        try:
            fut = self.pool.submit(self._stage, p, desc, diff_id, claims)
        except RuntimeError:  # the pool is shutting down: the run is being given up
            self.r.fail(diff_id, IntegrityError(f"{p.source_text}: import stopped"))
            return
        fut.add_done_callback(lambda f: self._settle(p, desc, diff_id, f))

    def _stage(self, p: _Plan, desc: Descriptor, diff_id: str, claims: Claims | None
               ) -> StagedLayer:
        r, source = self.r, p.source
        assert source is not None

        def tick_or_stop(n: int) -> None:
            if not r.wanted(diff_id):
                raise _Stopped
            r.tick(p, n)

        if not r.wanted(diff_id):
            raise _Stopped
        # a layer read while the layers being read already fill the cores (or while more
        # images of the run are being planned, whose layers will) is read lean, on its own
        # thread. Each stage on a thread of its own lets one layer use two cores; beside
        # other layers it only adds threads waiting for the GIL and for a core (docs/oci.md,
        # "Measured")
        with self.lock:
            lean = self.reading >= LEAN_BESIDE or (r.several and not r.all_planned)
            self.reading += 1
        try:
            # a connection that breaks mid-layer reads the layer again (transient failures
            # only, under the one retry policy); a source whose blobs share one file
            # position (a `docker save` tarball) opens them one at a time
            return retry.call(lambda: stage_layer(self.store, source, desc, diff_id,
                                                  known=self.known, tick=tick_or_stop,
                                                  claims=claims, writers=r.writers,
                                                  lean=lean),
                              f"importing layer {desc.digest or diff_id}", self.policy)
        finally:
            with self.lock:
                self.reading -= 1

    def _settle(self, p: _Plan, desc: Descriptor, diff_id: str, fut: Future[StagedLayer]
                ) -> None:
        r = self.r
        try:
            r.done[diff_id] = fut.result()
            r.layer_done()
        except ClaimLost:
            self.read(p, desc, diff_id, None)  # alone: no claims left to lose
            return
        except (_Stopped, CancelledError):
            r.fail(diff_id, IntegrityError(f"{p.source_text}: import stopped"))
        except (DsecError, *_INPUT_ERRORS) as e:
            r.fail(diff_id, _as_dsec_error(e, p.source.label if p.source else p.source_text))
        except BaseException as e:  # noqa: BLE001 - an interrupt: raised by the run
            r.interrupted = r.interrupted or e
            r.fail(diff_id, IntegrityError(f"{p.source_text}: interrupted"))
        r.settled[diff_id].set()


def _publish_ready(store: Store, ready: list[_Plan], r: _Run, tables: Path) -> None:
    """Publish images whose layers are all verified, in source order: only now does the
    store change. Several images ready at once share their writes (`_publish_images`);
    should that fail, each is published again on its own, so that one image's failure
    stays its own."""
    if len(ready) > 1:
        try:
            _publish_images(store, ready, r, tables)
            return
        except (DsecError, *_INPUT_ERRORS):
            pass  # the batch showed nothing (`Store.write_batch`): one image at a time
    for p in ready:
        if p.error is None and p.report is not None and not p.report.manifest:
            try:
                _publish_images(store, [p], r, tables)
            except (DsecError, *_INPUT_ERRORS) as e:
                p.error = _as_dsec_error(e, p.source_text)


def _publish_images(store: Store, ps: list[_Plan], r: _Run, tables: Path) -> None:
    """The packs of every layer the images name (those of the layers they took chunks from
    too), uploaded side by side; then each layer's index, manifest and ref, each image's
    manifest and then the images' refs, made durable together (one `Store.write_batch`,
    shown in that order). An image whose name was taken meanwhile fails alone (`p.error`;
    its objects are left for gc); a batch that fails raises, and shows none of them."""
    owners = {d: w for w, _ in r.writers if w.ok for d in w.written}
    writers: dict[int, _Writer] = {}
    for p in ps:
        for _, diff_id in p.layers:
            x = r.done[diff_id]
            if isinstance(x, StagedLayer) and diff_id not in r.imported:
                writers[id(x.w)] = x.w
                for pack in x.index.packs:  # chunks taken from other layers' packs
                    owner = owners.get(pack)
                    if owner is not None:
                        writers[id(owner)] = owner
    for w in writers.values():
        w.start_publish()
    for w in writers.values():
        w.publish()
    #: layers these images publish: known to later images only once the batch is durable
    #: (a batch that fails shows none of its objects, and a later image publishes them)
    newly: dict[str, ImportedLayer] = {}
    named: list[tuple[_Plan, str, list[ImportedLayer]]] = []
    with store.write_batch():  # the refs after every object: shown after them, too
        made = [_image_objects(store, p, r, tables, newly) for p in ps]
        for p, (digest, layers) in zip(ps, made, strict=True):
            try:
                if p.as_ref != "":  # "": the layers only (a spec's `from: [oci:...]`)
                    _set_image_ref(store, p.name, p.version, digest, p.replace)
            except (DsecError, *_INPUT_ERRORS) as e:
                p.error = _as_dsec_error(e, p.source_text)
                continue
            named.append((p, digest, layers))
    r.imported.update(newly)
    for p, digest, layers in named:
        assert p.report is not None
        p.report.layers = layers
        p.report.manifest = digest
        p.report.seconds = time.monotonic() - p.t0


def _image_objects(store: Store, p: _Plan, r: _Run, tables: Path,
                   newly: dict[str, ImportedLayer]) -> tuple[str, list[ImportedLayer]]:
    """Put an image's new layers (index, manifest, ref; their packs are in) and its
    manifest, inside the caller's write batch; return the manifest digest and the layers."""
    layers: list[ImportedLayer] = []
    for desc, diff_id in p.layers:
        x = r.done[diff_id]
        if isinstance(x, StagedLayer):
            earlier = r.imported.get(diff_id) or newly.get(diff_id)
            if earlier is None:
                newly[diff_id] = x.publish(store, tables)
                assert x.published is not None
                r.manifests[x.published[0]] = x.published[1]
                layers.append(newly[diff_id])
            else:  # published for an earlier image of the run (or listed twice)
                layers.append(replace(earlier, digest=desc.digest or "", reused=True,
                                      new_bytes=0))
        else:
            layers.append(replace(x, digest=desc.digest or ""))
    ann = dict(p.ann)
    ann["oci.source"] = p.source_text
    if p.top_digest:
        ann["oci.digest"] = p.top_digest
    digest, _ = write_image(store, p.name, p.version, [x.manifest for x in layers],
                            env=p.env, workdir=p.workdir, annotations=ann,
                            manifests=[r.manifests[x.manifest] for x in layers],
                            created_by=f"dsec import {p.source_text}")
    return digest, layers


class _Stopped(Exception):
    """A layer's read given up because every image that lists it has failed."""


def _chunk_tables() -> Path:
    """Where this machine caches the chunk tables of a store's indexes (`push.dedup`)."""
    from ..core.config import load_config

    return Path(load_config().data_dir) / "chunk-tables"


def _refuse_other_image(store: Store, name: str, version: str, source_digest: str) -> None:
    """Before anything is read: a ``name@version`` that names an image imported from another
    manifest (or not imported at all) is not moved without ``replace``."""
    try:
        current = get_ref(store, f"{name}@{version}").manifest
    except NotFoundError:
        return
    m = load_manifest(store, current)
    if not source_digest or m.annotations.get("oci.digest") != source_digest:
        raise RefConflictError(f"{name}@{version}", store.url, current,
                               f"an image from {source_digest or 'another source'}",
                               verb="this import would make it")


def _set_image_ref(store: Store, name: str, version: str, digest: str, replace: bool
                   ) -> None:
    """Versions are immutable (`refs.commit_ref`): the same import again makes the same
    manifest, and is a no-op."""
    commit_ref(store, name, version, digest, replace=replace, verb="this import made")
