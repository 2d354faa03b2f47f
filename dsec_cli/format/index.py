"""Layer indexes: the file tree of one layer and, for each regular file, where its bytes are.

Stored as zstd-compressed canonical JSON, named by the sha256 of the stored bytes.
The *content digest* of a layer is the sha256 of its canonical tree with chunk ids (no pack
locations, no codecs), so the same inputs give the same content digest wherever they are
built and however the store happened to pack them.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

import zstandard

from ..core.config import store_limits
from ..core.digests import put_object
from ..core.errors import FormatError
from . import canonical
from .codec import CODEC_ZGROUP
from .layout import ENTRY_TYPES
from .validate import bounded_zstd, check_size, fail, validate_index

try:  # index entries written as JSON in C (built by setup.py); else in Python
    from . import _entryjson  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on set-up
    _entryjson = None

#: the newest index format; 2 adds chunk groups (codec 2, format/codec.py). An index is
#: written as format 1 when none of its chunks is in a group, so older readers still read it
INDEX_VERSION = 2
INDEX_VERSIONS = (1, 2)
#: the content digest's own format number: it does not change with the stored form
CONTENT_VERSION = 1
# no import of the chunker here: reading indexes must not load the compiled chunker


@dataclass(frozen=True)
class ChunkParams:
    """FastCDC parameters; stored in each layer index so a reader knows how it was cut."""

    min_size: int = 16 << 10
    avg_size: int = 64 << 10
    max_size: int = 256 << 10
    #: files below this size are grouped into batch chunks instead of being cut alone
    small_file: int = 16 << 10
    #: zstd level for chunk data
    level: int = 3


def _put_name(d: dict[str, Any], key: str, name: str) -> None:
    """A path or link target into a stored entry. File names are bytes: in memory a name that
    is not valid UTF-8 is the surrogateescape-decoded str (as os.fsdecode gives); stored, it
    is the base64 of its exact bytes under ``<key>b`` instead of ``<key>``, so entries whose
    names are valid UTF-8 (and the digests of all-UTF-8 trees) are as they always were."""
    if name.isascii():  # the common case: no surrogate can be in it
        d[key] = name
        return
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        d[key + "b"] = base64.b64encode(name.encode("utf-8", "surrogateescape")).decode()
    else:
        d[key] = name


def _get_name(d: dict[str, Any], key: str) -> str:
    if key + "b" in d:
        if key in d:
            raise FormatError(f"index entry has both {key!r} and {key + 'b'!r}")
        try:
            raw = base64.b64decode(d[key + "b"], validate=True)
        except (ValueError, TypeError) as e:
            raise FormatError(f"index entry field {key + 'b'!r} is not base64") from e
        name = raw.decode("utf-8", "surrogateescape")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            return name
        # one spelling per name, or one tree would have two content digests
        raise FormatError(f"index entry field {key + 'b'!r} holds valid UTF-8 {name!r}: it "
                          f"belongs in {key!r}")
    name = d[key]
    if not isinstance(name, str):
        raise FormatError(f"index entry field {key!r} is not a string")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # a JSON escape of a lone surrogate would alias a non-UTF-8 name's in-memory form
        raise FormatError(f"index entry name {name!r} is not valid Unicode") from None
    return name


@dataclass
class Entry:
    """One path of a layer. ``path`` is relative to the root, '.' for the root itself."""

    path: str
    type: str
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 0  # nanoseconds since the epoch
    size: int = 0
    target: str = ""  # symlink target, or the path a hardlink shares its inode with
    rdev: tuple[int, int] | None = None
    xattrs: dict[str, bytes] = field(default_factory=dict)
    opaque: bool = False  # directory hides the lower layers' contents (overlayfs opaque)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (chunk#, offset, length)

    def to_doc(self) -> dict[str, Any]:
        d: dict[str, Any] = {"t": self.type}
        _put_name(d, "p", self.path)
        if self.type not in ("whiteout",):
            d.update(m=self.mode, u=self.uid, g=self.gid, mt=self.mtime)
        if self.size:
            d["s"] = self.size
        if self.target:
            _put_name(d, "l", self.target)
        if self.rdev is not None:
            d["rd"] = list(self.rdev)
        if self.xattrs:
            d["x"] = {k: base64.b64encode(v).decode() for k, v in sorted(self.xattrs.items())}
        if self.opaque:
            d["o"] = True
        if self.chunks:
            d["c"] = [list(c) for c in self.chunks]
        return d

    @classmethod
    def from_doc(cls, d: dict[str, Any]) -> Entry:
        t = d["t"]
        if t not in ENTRY_TYPES:
            raise FormatError(f"index entry {d.get('p')!r} has unknown type {t!r}")
        target = _get_name(d, "l") if "l" in d or "lb" in d else ""
        return cls(
            path=_get_name(d, "p"), type=t, mode=d.get("m", 0), uid=d.get("u", 0),
            gid=d.get("g", 0), mtime=d.get("mt", 0), size=d.get("s", 0), target=target,
            rdev=tuple(d["rd"]) if "rd" in d else None,  # type: ignore[arg-type]
            xattrs={k: base64.b64decode(v) for k, v in d.get("x", {}).items()},
            opaque=d.get("o", False), chunks=[tuple(c) for c in d.get("c", [])],  # type: ignore[misc]
        )


class EntryJson:
    """Entries turned into their stored and content-digest JSON, a slice at a time (the
    layer writer serializes the entries it is done with while chunks compress). ``ids``
    are the chunk ids by chunk number; it may grow as long as every entry added refers only
    to chunks already in it."""

    def __init__(self, ids: list[bytes]) -> None:
        self.ids = ids
        self._stored: list[bytes] = []
        self._content: list[bytes] = []

    def add(self, entries: list[Entry]) -> None:
        if not entries:
            return
        if _entryjson is not None:  # the same bytes, written from the entries in C
            stored_items, content_items = _entryjson.items(entries, self.ids, self._one)
            self._stored.append(stored_items)
            self._content.append(content_items)
            return
        ids = self.ids
        stored, content = [], []
        for e in entries:
            d = e.to_doc()
            stored.append(d)
            if e.chunks:
                d = {**d, "c": [[ids[i].hex(), off, ln] for i, off, ln in e.chunks]}
            content.append(d)
        # each slice is a JSON array; its items are joined into one array below
        self._stored.append(canonical.dumps(stored)[1:-1])
        self._content.append(canonical.dumps(content)[1:-1])

    def _one(self, e: Entry) -> tuple[bytes, bytes]:
        """One entry's two items the Python way (what `_entryjson` leaves: xattrs, device
        numbers, names that are not UTF-8, unexpected field types)."""
        d = e.to_doc()
        stored = canonical.dumps(d)
        if e.chunks:
            d = {**d, "c": [[self.ids[i].hex(), off, ln] for i, off, ln in e.chunks]}
        return stored, canonical.dumps(d)

    def arrays(self) -> tuple[bytes, bytes]:
        """(stored array, content array): exactly the `canonical.dumps` of the lists of
        entry documents."""
        return (b"[" + b",".join(self._stored) + b"]", b"[" + b",".join(self._content) + b"]")


@dataclass(frozen=True)
class ChunkLoc:
    """Where one chunk is stored: pack (position in LayerIndex.packs), byte range, codec."""

    chunk_id: bytes
    pack: int
    offset: int
    clen: int
    ulen: int
    codec: int
    sha256: bytes | None = None  # optional cryptographic digest of the uncompressed bytes


@dataclass
class LayerIndex:
    entries: list[Entry]
    chunks: list[ChunkLoc]
    packs: list[str]
    params: ChunkParams = field(default_factory=ChunkParams)
    prefetch: list[str] = field(default_factory=list)
    chunk_hash: str = "xxh3-128"
    #: the entries' stored and content-digest JSON arrays, when the writer serialized them
    #: as it went (`EntryJson.arrays`); else they are made from ``entries`` when needed
    entry_json: tuple[bytes, bytes] | None = field(default=None, repr=False, compare=False)
    # computed once; an index is not modified after it is written
    _stored: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _content_digest: str | None = field(default=None, init=False, repr=False, compare=False)

    def stored_bytes(self) -> int:
        """Compressed bytes of the chunks this index reads, each stored range counted once:
        the members of a chunk group (codec 2) share the group's frame, and every member's
        range ends where the frame ends, so a group counts as its longest member range."""
        longest: dict[tuple[int, int], int] = {}
        for c in self.chunks:
            end = (c.pack, c.offset + c.clen)
            if c.clen > longest.get(end, -1):
                longest[end] = c.clen
        return sum(longest.values())

    def content_digest(self) -> str:
        """sha256 of the canonical tree with chunk ids, computed from the entries held (a
        reader compares it with what a manifest claims; it never trusts the claim)."""
        if self._content_digest is None:
            self._entries_json()
        assert self._content_digest is not None
        return self._content_digest

    def _entries_json(self) -> bytes:
        """The stored entries as one JSON array; computes the content digest in the same
        pass. A writer that serialized the entries as it went (`EntryJson`) hands both
        arrays over in ``entry_json``."""
        if self.entry_json is not None:
            stored, content = self.entry_json
        else:
            ej = EntryJson([c.chunk_id for c in self.chunks])
            ej.add(self.entries)
            stored, content = ej.arrays()
        self._content_digest = hashlib.sha256(canonical.dumps_with(
            {"format": CONTENT_VERSION, "chunk_hash": self.chunk_hash},
            {"entries": content})).hexdigest()
        return stored

    def to_bytes(self) -> bytes:
        """The stored form; computes the content digest in the same pass."""
        if self._stored is not None:
            return self._stored
        stored_entries = self._entries_json()
        has_sha = any(c.sha256 for c in self.chunks)
        grouped = any(c.codec == CODEC_ZGROUP for c in self.chunks)
        doc = {
            "format": INDEX_VERSION if grouped else 1,
            "chunk_hash": self.chunk_hash,
            "chunk_sha256": has_sha,
            "params": {"min": self.params.min_size, "avg": self.params.avg_size,
                       "max": self.params.max_size, "small": self.params.small_file,
                       "level": self.params.level},
            "packs": self.packs,
            "prefetch": self.prefetch,
        }
        # the chunk table written row by row: the bytes `canonical.dumps` gives for these
        # rows (hex strings need no escaping, ints print alike), at a third of its cost
        if has_sha:
            rows = [f'["{c.chunk_id.hex()}",{c.pack},{c.offset},{c.clen},{c.ulen},{c.codec},'
                    f'"{c.sha256.hex() if c.sha256 else ""}"]' for c in self.chunks]
        else:
            rows = [f'["{c.chunk_id.hex()}",{c.pack},{c.offset},{c.clen},{c.ulen},{c.codec}]'
                    for c in self.chunks]
        chunks = ("[" + ",".join(rows) + "]").encode()
        self._stored = zstandard.ZstdCompressor(level=3).compress(
            canonical.dumps_with(doc, {"entries": stored_entries, "chunks": chunks}))
        return self._stored

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "index", json_bytes: int | None = None
                   ) -> LayerIndex:
        """Decode and validate a stored index (format/validate.py); every failure is a
        CorruptObjectError naming `what`, and memory stays within the configured bounds
        (and within ``json_bytes`` of decoded JSON, when given)."""
        lim = store_limits()
        check_size(what, data, lim.index_bytes, "index_bytes")
        limit = lim.index_json_bytes if json_bytes is None else min(json_bytes,
                                                                    lim.index_json_bytes)
        raw = bounded_zstd(data, limit, what, "index_json_bytes")
        doc = canonical.loads(raw, what)
        if not isinstance(doc, dict):
            fail(what, "not a JSON object")
        if doc.get("format") not in INDEX_VERSIONS:
            raise FormatError(f"{what} has format {doc.get('format')}; this dsec reads "
                              f"{', '.join(map(str, INDEX_VERSIONS))}: upgrade dsec")
        if doc.get("chunk_hash") != "xxh3-128":
            raise FormatError(f"{what} uses chunk hash {doc.get('chunk_hash')!r}, unsupported")
        try:
            ix = cls._from_doc(doc)
        except FormatError as e:
            fail(what, e.message)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            fail(what, f"a field is missing or of the wrong type ({type(e).__name__}: {e})")
        return validate_index(ix, what, lim)

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> LayerIndex:
        p = doc["params"]
        has_sha = doc.get("chunk_sha256", False)
        chunks = [ChunkLoc(bytes.fromhex(c[0]), c[1], c[2], c[3], c[4], c[5],
                           bytes.fromhex(c[6]) if has_sha and c[6] else None)
                  for c in doc["chunks"]]
        return cls(
            entries=[Entry.from_doc(e) for e in doc["entries"]], chunks=chunks,
            packs=doc["packs"], prefetch=doc.get("prefetch", []),
            params=ChunkParams(p["min"], p["avg"], p["max"], p["small"], p["level"]),
        )


def put_index(store: Any, index: LayerIndex) -> str:
    """Store an index under the sha256 of its stored bytes; return the digest."""
    return put_object(store, "indexes", index.to_bytes())
