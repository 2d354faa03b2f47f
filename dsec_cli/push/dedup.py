"""The chunks a store already holds, so a writer references them instead of storing them again.

Built from the indexes of every layer reachable from the store's refs; indexes are immutable,
so their chunk tables are cached on this machine by digest and loading is cheap after the
first time.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from ..core.digests import check_digest, object_key
from ..core.errors import DsecError
from ..format.index import LayerIndex
from ..format.manifest import load_manifest
from ..format.refs import list_refs
from ..format.validate import is_digest
from .stores.base import Store

log = logging.getLogger(__name__)

_REC = struct.Struct("<16sIQIIB")  # chunk id, pack#, offset, clen, ulen, codec


@dataclass(frozen=True)
class KnownChunk:
    pack: str
    offset: int
    clen: int
    ulen: int
    codec: int


def load_index(store: Store, digest: str) -> LayerIndex:
    """A layer index, checked against its digest and validated field by field."""
    from ..core.digests import verify_sha256

    what = f"index {check_digest(digest)[:12]}"
    data = store.get(object_key("indexes", digest))
    return LayerIndex.from_bytes(verify_sha256(data, digest, what), what)


class KnownChunks:
    """chunk id -> where it is stored, for one store."""

    def __init__(self) -> None:
        self.chunks: dict[bytes, KnownChunk] = {}

    def __len__(self) -> int:
        return len(self.chunks)

    def get(self, chunk_id: bytes) -> KnownChunk | None:
        return self.chunks.get(chunk_id)

    def add_index(self, index: LayerIndex) -> None:
        for c in index.chunks:
            self.chunks.setdefault(c.chunk_id, KnownChunk(index.packs[c.pack], c.offset, c.clen,
                                                          c.ulen, c.codec))

    @classmethod
    def load(cls, store: Store, cache_dir: Path | None = None,
             exclude_packs: set[str] | None = None) -> KnownChunks:
        known = cls()
        seen: set[str] = set()
        for ref in list_refs(store):
            try:
                _collect(store, ref.manifest, seen, known, cache_dir)
            except DsecError as e:  # a broken ref must not stop other writers
                log.warning("ignoring %s for dedup: %s", ref.ref, e)
        if exclude_packs:
            known.chunks = {k: v for k, v in known.chunks.items() if v.pack not in exclude_packs}
        return known


#: chunk tables already parsed by this process, by index digest (indexes are immutable): a
#: process importing or building again and again reads each table from disk once. Bounded
#: by rows held; past the bound, tables are parsed from disk again.
_PARSED: dict[str, dict[bytes, KnownChunk]] = {}
_PARSED_ROWS = 0
PARSED_MAX_ROWS = 1 << 18
_PARSED_LOCK = threading.Lock()


def _add_parsed(index_digest: str, table: dict[bytes, KnownChunk], known: KnownChunks) -> None:
    global _PARSED_ROWS
    with _PARSED_LOCK:
        if index_digest not in _PARSED and _PARSED_ROWS + len(table) <= PARSED_MAX_ROWS:
            _PARSED[index_digest] = table
            _PARSED_ROWS += len(table)
    if not known.chunks:
        known.chunks = dict(table)
        return
    for cid, k in table.items():
        known.chunks.setdefault(cid, k)


def _add_table(data: bytes, known: KnownChunks, index_digest: str | None = None) -> bool:
    """Add a cached chunk table; False when it is damaged (then the index is read again).
    It is written only from validated indexes, but a disk can truncate it."""
    try:
        npacks = struct.unpack_from("<I", data)[0]
        off = 4
        packs = [data[off + 64 * i: off + 64 * (i + 1)].decode() for i in range(npacks)]
        off += 64 * npacks
        rows = list(_REC.iter_unpack(data[off:]))
        if not all(is_digest(p) for p in packs) or any(r[1] >= npacks for r in rows):
            return False
    except (struct.error, UnicodeDecodeError):
        return False
    if index_digest is None:
        for cid, p, o, cl, ul, codec in rows:
            known.chunks.setdefault(cid, KnownChunk(packs[p], o, cl, ul, codec))
        return True
    table: dict[bytes, KnownChunk] = {}
    for cid, p, o, cl, ul, codec in rows:
        table.setdefault(cid, KnownChunk(packs[p], o, cl, ul, codec))
    _add_parsed(index_digest, table, known)
    return True


def _collect(store: Store, digest: str, seen: set[str], known: KnownChunks,
             cache_dir: Path | None) -> None:
    if digest in seen:
        return
    seen.add(digest)
    m = load_manifest(store, digest)
    for layer in m.layers:
        _collect(store, layer, seen, known, cache_dir)
    if m.index and m.index not in seen:
        seen.add(m.index)
        try:
            _add_cached(store, m.index, known, cache_dir)
        except DsecError as e:  # one bad index must not stop builds: its chunks go unused
            log.warning("ignoring index %s of %s for dedup: %s", m.index[:12], m.ref, e)


def _add_cached(store: Store, index_digest: str, known: KnownChunks,
                cache_dir: Path | None) -> None:
    """Chunk tables are kept on disk in a compact binary form keyed by index digest."""
    path = cache_dir / check_digest(index_digest) if cache_dir else None
    if path is not None and index_digest in _PARSED and path.is_file():
        _add_parsed(index_digest, _PARSED[index_digest], known)
        return
    if path is not None and path.is_file() and _add_table(path.read_bytes(), known,
                                                          index_digest):
        return
    index = load_index(store, index_digest)
    known.add_index(index)
    if cache_dir is not None:
        cache_table(cache_dir, index_digest, index)


def cache_table(cache_dir: Path, index_digest: str, index: LayerIndex) -> None:
    """Keep the chunk table of an index read and validated here, or written here (a writer
    that just stored an index saves the next `KnownChunks.load` from reading it again)."""
    path = cache_dir / check_digest(index_digest)
    body = b"".join(_REC.pack(c.chunk_id, c.pack, c.offset, c.clen, c.ulen, c.codec)
                    for c in index.chunks)
    blob = struct.pack("<I", len(index.packs)) + "".join(index.packs).encode() + body
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
