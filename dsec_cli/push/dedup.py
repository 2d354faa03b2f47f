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
from pathlib import Path
from typing import Any, NamedTuple

from ..core.digests import check_digest, object_key, verify_sha256
from ..core.errors import DsecError
from ..core.reads import read_all
from ..format.index import LayerIndex
from ..format.manifest import Manifest, load_manifest
from ..format.refs import list_refs
from ..format.validate import is_digest
from .stores.base import Store

log = logging.getLogger(__name__)

_REC = struct.Struct("<16sIQIIB")  # chunk id, pack#, offset, clen, ulen, codec


class KnownChunk(NamedTuple):
    """Where a chunk is stored (made per lookup: a tuple is the cheapest object to make)."""

    pack: str
    offset: int
    clen: int
    ulen: int
    codec: int


def load_index(store: Store, digest: str, json_ratio: int | None = None) -> LayerIndex:
    """A layer index, checked against its digest and validated field by field; with
    ``json_ratio``, refused once its JSON passes that many times its stored bytes (and
    `INDEX_JSON_FLOOR`), before it is decoded past that."""
    what = f"index {check_digest(digest)[:12]}"
    data = store.get(object_key("indexes", digest))
    bound = None if json_ratio is None else max(INDEX_JSON_FLOOR, len(data) * json_ratio)
    return LayerIndex.from_bytes(verify_sha256(data, digest, what), what, bound)


#: Dedup reads the index of every layer in the store, asked for or not, so it decodes each
#: within a tight bound: real indexes are 6-8 times their stored bytes (chunk ids do not
#: compress), a bomb thousands of times. An index past the bound only goes unused for dedup.
INDEX_JSON_RATIO = 32
INDEX_JSON_FLOOR = 16 << 20


try:
    from . import _known  # type: ignore[attr-defined]
except ImportError:  # not built (setup.py builds it): a dict of tuples holds them
    _known = None

#: hold the chunks in the compiled table (tests turn it off to compare both)
use_compiled = _known is not None


class _DictTable:
    """`_known.Table` in Python: the same rows, a tuple per chunk in a dict."""

    def __init__(self) -> None:
        self.rows: dict[bytes, tuple[int, int, int, int, int]] = {}

    def add(self, data: bytes | memoryview, npacks: int, base: int) -> bool:
        if len(data) % _REC.size:
            return False
        rows = list(_REC.iter_unpack(data))
        if any(r[1] >= npacks for r in rows):
            return False
        for cid, p, o, cl, ul, codec in rows:
            self.rows.setdefault(cid, (p + base, o, cl, ul, codec))
        return True

    def get(self, chunk_id: bytes) -> tuple[int, int, int, int, int] | None:
        return self.rows.get(chunk_id)

    def items(self) -> list[tuple[bytes, int, int, int, int, int]]:
        return [(k, *v) for k, v in self.rows.items()]

    def __len__(self) -> int:
        return len(self.rows)


def _table_blob(index: LayerIndex) -> bytes:
    """An index's chunk table in its cached form: the pack count, the packs, the rows."""
    body = b"".join(_REC.pack(c.chunk_id, c.pack, c.offset, c.clen, c.ulen, c.codec)
                    for c in index.chunks)
    return struct.pack("<I", len(index.packs)) + "".join(index.packs).encode() + body


class KnownChunks:
    """chunk id -> where it is stored, for one store: the chunk tables of the indexes its
    refs reach, in one table (`_known.Table` where built: about 50 bytes per chunk, a
    library's millions of chunks loaded at memory speed), and the chunks of indexes
    written since by this process (`add_index`)."""

    def __init__(self) -> None:
        k0, k1 = struct.unpack("<QQ", os.urandom(16))  # the table's slots, keyed per table
        self.table: Any = (_known.Table(k0, k1) if use_compiled and _known is not None
                           else _DictTable())
        self.packs: list[str] = []  # the table's pack numbers
        self.added: dict[bytes, KnownChunk] = {}
        self.dropped: set[str] = set()  # packs no chunk is taken from (`drop_packs`)

    def get(self, chunk_id: bytes) -> KnownChunk | None:
        row = self.table.get(chunk_id)
        if row is not None:
            pack = self.packs[row[0]]
            if pack not in self.dropped:
                return KnownChunk(pack, row[1], row[2], row[3], row[4])
        k = self.added.get(chunk_id)
        return None if k is None or k.pack in self.dropped else k

    def add_index(self, index: LayerIndex) -> None:
        """The chunks of an index this process wrote; a chunk known already keeps where it
        was."""
        for c in index.chunks:
            row = self.table.get(c.chunk_id)
            if row is None or self.packs[row[0]] in self.dropped:
                self.added.setdefault(c.chunk_id, KnownChunk(index.packs[c.pack], c.offset,
                                                             c.clen, c.ulen, c.codec))

    def add_table(self, data: bytes | memoryview) -> bool:
        """A chunk table in its cached form (`cache_table`); False, with nothing added, when
        it is damaged (it is written only from validated indexes, but a disk can truncate
        it)."""
        try:
            npacks = struct.unpack_from("<I", data)[0]
            off = 4 + 64 * npacks
            if off > len(data):
                return False
            packs = [bytes(data[4 + 64 * i:4 + 64 * (i + 1)]).decode() for i in range(npacks)]
        except (struct.error, UnicodeDecodeError):
            return False
        if not all(is_digest(p) for p in packs):
            return False
        if not self.table.add(memoryview(data)[off:], npacks, len(self.packs)):
            return False
        self.packs += packs
        return True

    def drop_packs(self, packs: set[str]) -> None:
        """No chunk is taken from these packs any more (discarded, or being removed)."""
        self.dropped |= packs

    @property
    def chunks(self) -> dict[bytes, KnownChunk]:
        """Every chunk known, as a dict made on each call (to look at; `get` is the lookup)."""
        out: dict[bytes, KnownChunk] = {}
        for cid, p, o, cl, ul, codec in self.table.items():
            if self.packs[p] not in self.dropped:
                out[cid] = KnownChunk(self.packs[p], o, cl, ul, codec)
        for cid, k in self.added.items():
            if k.pack not in self.dropped:
                out.setdefault(cid, k)
        return out

    @classmethod
    def load(cls, store: Store, cache_dir: Path | None = None,
             exclude_packs: set[str] | None = None) -> KnownChunks:
        known = cls()
        seen: set[str] = set()
        refs = list_refs(store)
        manifests = _read_manifests(store, [r.manifest for r in refs])
        for ref in refs:
            try:
                _collect(store, ref.manifest, seen, known, cache_dir, manifests)
            except DsecError as e:  # a broken ref must not stop other writers
                log.warning("ignoring %s for dedup: %s", ref.ref, e)
        if exclude_packs:
            known.drop_packs(exclude_packs)
        return known


#: chunk tables already read by this process, by index digest (indexes are immutable): a
#: process importing or building again and again reads each from disk once. Bounded by
#: rows held; past the bound, tables are read from disk again.
_READ_TABLES: dict[str, bytes] = {}
_READ_ROWS = 0
READ_MAX_ROWS = 1 << 20
_READ_LOCK = threading.Lock()


def _keep_read(index_digest: str, data: bytes) -> None:
    global _READ_ROWS
    rows = len(data) // _REC.size
    with _READ_LOCK:
        if index_digest not in _READ_TABLES and _READ_ROWS + rows <= READ_MAX_ROWS:
            _READ_TABLES[index_digest] = data
            _READ_ROWS += rows


def _read_table(path: Path) -> bytes:
    return path.read_bytes()


def _read_manifests(store: Store, digests: list[str]) -> dict[str, Manifest | Exception]:
    """Every manifest the refs reach (images, then their layers), read side by side from a
    remote store (`core.reads`): each read there is a round trip. A manifest that cannot
    be read is kept as its error, raised where the walk meets it."""
    got: dict[str, Manifest | Exception] = {}
    level = list(dict.fromkeys(digests))
    while level:
        for d, m in zip(level, read_all(store, lambda d: load_manifest(store, d), level),
                        strict=True):
            got[d] = m
        below: list[str] = []
        for d in level:
            m = got[d]
            if isinstance(m, Manifest):
                below += [x for x in m.layers if x not in got]
        level = list(dict.fromkeys(below))
    return got


def _collect(store: Store, digest: str, seen: set[str], known: KnownChunks,
             cache_dir: Path | None, manifests: dict[str, Manifest | Exception]) -> None:
    if digest in seen:
        return
    seen.add(digest)
    m = manifests.get(digest)
    if m is None:
        m = load_manifest(store, digest)
    elif isinstance(m, Exception):
        raise m
    for layer in m.layers:
        _collect(store, layer, seen, known, cache_dir, manifests)
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
    if path is not None and path.is_file():
        data = _READ_TABLES.get(index_digest)
        if data is not None and known.add_table(data):
            return
        data = _read_table(path)
        if known.add_table(data):
            _keep_read(index_digest, data)
            return
    index = load_index(store, index_digest, INDEX_JSON_RATIO)
    blob = (cache_table(cache_dir, index_digest, index) if cache_dir is not None
            else _table_blob(index))
    known.add_table(blob)  # validated: its table is whole


def cache_table(cache_dir: Path, index_digest: str, index: LayerIndex) -> bytes:
    """Keep the chunk table of an index read and validated here, or written here (a writer
    that just stored an index saves the next `KnownChunks.load` from reading it again);
    returns the table in its cached form."""
    path = cache_dir / check_digest(index_digest)
    blob = _table_blob(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return blob
