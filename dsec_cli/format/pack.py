"""Packs: blobs of several MiB holding chunks (alone or in chunk groups, each one decodable
from its own byte range: format/codec.py), named by sha256.

Layout (version 1)::

    b"DSECPK\\x00\\x01"                    8-byte header: magic and format version
    chunk frames ...                       each chunk's (or chunk group's) stored bytes
    trailer                                zstd(canonical JSON table of contents)
    trailer length (u64, little endian)
    b"DSECPKND"

The layer index alone says where every chunk is; the trailer makes a pack self-describing
so that gc can repack it and a damaged index can be rebuilt from packs.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zstandard

from ..core.config import store_limits
from . import canonical
from .codec import CODEC_ZGROUP, Piece
from .layout import HEADER
from .validate import bounded_zstd, fail, validate_toc

FOOTER_MAGIC = b"DSECPKND"
FOOTER = struct.Struct("<Q8s")
#: table-of-contents versions this dsec reads: 2 adds chunk groups (codec 2)
TOC_VERSIONS = (1, 2)


@dataclass(frozen=True)
class PackedChunk:
    chunk_id: bytes
    offset: int
    clen: int
    ulen: int
    codec: int


@dataclass(frozen=True)
class FinishedPack:
    path: Path
    digest: str
    size: int
    chunks: list[PackedChunk]


def process_umask() -> int:
    """The process's umask, read without setting it (os.umask is a write, racing threads)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


class PackWriter:
    """Appends encoded chunks to a temporary file and seals it into a pack."""

    def __init__(self, tmp_dir: Path) -> None:
        fd, name = tempfile.mkstemp(prefix="pack-", suffix=".tmp", dir=tmp_dir)
        # a pack is linked into the store as it is: its mode follows the umask as every
        # other store object's does (mkstemp's 0600 made a root-written store unreadable to
        # the users it is shared with)
        os.fchmod(fd, 0o666 & ~process_umask())
        self.path = Path(name)
        # a buffer for the small writes; a group's frame (hundreds of KiB) goes to the file
        # as it is, not copied through the buffer
        self._f = os.fdopen(fd, "wb", buffering=64 << 10)
        self._hash = hashlib.sha256()
        self._chunks: list[PackedChunk] = []
        self.size = 0
        self._write(HEADER)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def add(self, chunk_id: bytes, codec: int, stored: bytes, ulen: int) -> PackedChunk:
        pc = PackedChunk(chunk_id, self.size, len(stored), ulen, codec)
        self._write(stored)
        self._chunks.append(pc)
        return pc

    def add_blob(self, pieces: list[Piece], rows: list[tuple[bytes, int, int, int, int]]
                 ) -> list[PackedChunk]:
        """Stored bytes holding several chunks (a group, format/codec.py), given as pieces
        written one after the other; ``rows`` are (id, codec, offset in the blob, clen,
        ulen). The chunks' ranges may overlap."""
        base = self.size
        for piece in pieces:
            self._write(piece)
        out = [PackedChunk(cid, base + off, clen, ulen, codec)
               for cid, codec, off, clen, ulen in rows]
        self._chunks += out
        return out

    def __len__(self) -> int:
        return len(self._chunks)

    def finish(self) -> FinishedPack:
        # format 2 says the pack holds chunk groups (codec 2), which a reader of format 1
        # cannot decode
        fmt = 2 if any(c.codec == CODEC_ZGROUP for c in self._chunks) else 1
        toc = canonical.dumps({"format": fmt, "chunks": [
            [c.chunk_id.hex(), c.offset, c.clen, c.ulen, c.codec] for c in self._chunks]})
        trailer = zstandard.ZstdCompressor(level=3).compress(toc)
        self._write(trailer)
        self._write(FOOTER.pack(len(trailer), FOOTER_MAGIC))
        self._f.close()
        return FinishedPack(self.path, self._hash.hexdigest(), self.size, self._chunks)

    def abort(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)


def read_toc(data: bytes, what: str = "pack") -> list[PackedChunk]:
    """The table of contents of a whole pack (used by repack, verify and recovery); every
    row is validated to lie inside the pack's body (format/validate.py)."""
    if not data.startswith(HEADER):
        fail(what, "not a dsec pack (bad header) or an unsupported pack version")
    if len(data) < len(HEADER) + FOOTER.size:
        fail(what, f"{len(data)} bytes is too short for a pack")
    tlen, magic = FOOTER.unpack_from(data, len(data) - FOOTER.size)
    if magic != FOOTER_MAGIC:
        fail(what, "the trailer is damaged (bad end magic)")
    body_end = len(data) - FOOTER.size - tlen
    if not len(HEADER) <= body_end:
        fail(what, f"trailer length {tlen} is longer than the pack")
    lim = store_limits()
    raw = bounded_zstd(memoryview(data)[body_end:len(data) - FOOTER.size],
                       lim.pack_trailer_bytes, f"{what} trailer", "pack_trailer_bytes")
    doc = canonical.loads(raw, f"{what} trailer")
    if not isinstance(doc, dict) or doc.get("format") not in TOC_VERSIONS:
        fail(what, f"the trailer is not a table of contents of a version this dsec reads "
                   f"({', '.join(map(str, TOC_VERSIONS))})")
    return [PackedChunk(*row) for row in validate_toc(doc.get("chunks"), what, body_end, lim)]
