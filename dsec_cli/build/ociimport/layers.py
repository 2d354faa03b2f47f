"""One OCI layer into a staged dsec layer. The blob is read as one stream (`oci.streams`):
blob -> sha256 (the manifest's digest) -> gzip or zstd (sniffed) -> sha256 (the config's
uncompressed ``diff_id``) -> tar members. Files of at least ``small_file`` bytes are chunked
as the stream reaches them (one window of chunks in memory); smaller ones wait in a spool
(in memory, a bytes object each, up to `SPOOL_MEMORY`, then in a file in staging) until the
end of the layer, because they are grouped into batch chunks in path order, exactly as
`dsec build` groups them, so an image imported, exported and imported again has the same
content digests. Packs stay in staging until both digests match: a layer whose bytes do not
match is refused, naming the digest, and the store is unchanged.

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
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ...core.errors import IntegrityError, NotFoundError, SpecError
from ...format.index import ChunkParams, Entry, LayerIndex
from ...format.manifest import Manifest, load_manifest
from ...format.refs import get_ref, set_ref
from ...oci.sources import Descriptor, Source
from ...oci.streams import NO_HASH, HashBehind, Hashed, Prefetch, decompressed
from ...push.dedup import KnownChunks, cache_table
from ...push.stores.base import Store
from ..layer import Claims, _Batcher, _Writer, canonical_entries, chunk_stream, layer_manifest
from ..tarball import MAX_SPARSE_SIZE, scan_members
from ..tarhdr import StreamTarFile, tarinfo_class
from .reports import ImportedLayer

LAYER_NAME = "oci-layer"
#: a layer's small files wait in memory up to this many bytes, then in a staging file
SPOOL_MEMORY = 64 << 20
#: how imported layers are cut and stored: the build's chunking, zstd at level 1. An import
#: is a conversion on the way to a sandbox (`from: [oci:...]` waits for it), its new bytes
#: are mostly one base image's, and zstd is the largest part of its CPU after the inflate:
#: level 1 compresses a Python tree's 1 MiB groups about 1.4x as fast as level 3 for about
#: a tenth more stored bytes (docs/oci.md, "Measured")
IMPORT_PARAMS = ChunkParams(level=1)


class Spool:
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


def _scan_layer(tf: tarfile.TarFile, ahead: Prefetch, label: str, w: _Writer,
                params: ChunkParams, spool: Spool) -> list[Entry]:
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


def remove_dirs(paths: list[Path]) -> None:
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
        spool = Spool(staging)
        with source.blob(desc) as f, contextlib.closing(spool):
            # four threads per layer: the blob's bytes come in (a registry's are waited
            # for) and are hashed on one, inflated on a second, the inflated bytes hashed
            # on a third, parsed and chunked here; lean, all on this one
            raw = Hashed(f, desc.size if desc.digest else None, tick)
            fetched: Hashed | Prefetch = raw if lean else Prefetch(
                raw, depth=2, name="oci-blob-read")
            head = Hashed(fetched, h=NO_HASH)  # only to sniff the compression
            plain = Hashed(None, h=hashlib.sha256() if lean else HashBehind())
            ahead = None
            try:
                plain.f = decompressed(head)
                ahead = Prefetch(plain, thread=not lean)
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
                if isinstance(fetched, Prefetch):
                    fetched.close()
                if isinstance(plain.h, HashBehind):
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


def existing_layer(store: Store, diff_id: str) -> tuple[str, Manifest] | None:
    try:
        digest = get_ref(store, f"{LAYER_NAME}@{diff_id.removeprefix('sha256:')}").manifest
        return digest, load_manifest(store, digest)
    except NotFoundError:
        return None
