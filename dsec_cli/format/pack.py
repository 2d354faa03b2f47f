"""Packs: blobs of several MiB holding independently compressed chunks, named by sha256.

Layout (version 1)::

    b"DSECPK\\x00\\x01"                    8-byte header: magic and format version
    chunk frames ...                       each chunk's stored bytes, back to back
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

from ..core.errors import FormatError
from . import canonical

HEADER = b"DSECPK\x00\x01"
FOOTER_MAGIC = b"DSECPKND"
FOOTER = struct.Struct("<Q8s")


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


class PackWriter:
    """Appends encoded chunks to a temporary file and seals it into a pack."""

    def __init__(self, tmp_dir: Path) -> None:
        fd, name = tempfile.mkstemp(prefix="pack-", suffix=".tmp", dir=tmp_dir)
        self.path = Path(name)
        self._f = os.fdopen(fd, "wb", buffering=1 << 20)
        self._hash = hashlib.sha256()
        self._chunks: list[PackedChunk] = []
        self.size = 0
        self._write(HEADER)

    def _write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def add(self, chunk_id: bytes, codec: int, stored: bytes, ulen: int) -> PackedChunk:
        pc = PackedChunk(chunk_id, self.size, len(stored), ulen, codec)
        self._write(stored)
        self._chunks.append(pc)
        return pc

    def __len__(self) -> int:
        return len(self._chunks)

    def finish(self) -> FinishedPack:
        toc = canonical.dumps({"format": 1, "chunks": [
            [c.chunk_id.hex(), c.offset, c.clen, c.ulen, c.codec] for c in self._chunks]})
        trailer = zstandard.ZstdCompressor(level=3).compress(toc)
        self._write(trailer)
        self._write(FOOTER.pack(len(trailer), FOOTER_MAGIC))
        self._f.close()
        return FinishedPack(self.path, self._hash.hexdigest(), self.size, self._chunks)

    def abort(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)


def read_toc(data: bytes) -> list[PackedChunk]:
    """The table of contents of a whole pack (used by repack and recovery)."""
    if not data.startswith(HEADER):
        raise FormatError("not a dsec pack (bad header) or an unsupported pack version")
    tlen, magic = FOOTER.unpack_from(data, len(data) - FOOTER.size)
    if magic != FOOTER_MAGIC:
        raise FormatError("pack trailer is damaged")
    start = len(data) - FOOTER.size - tlen
    doc = canonical.loads(zstandard.ZstdDecompressor().decompress(
        data[start:len(data) - FOOTER.size], max_output_size=64 << 20), "pack trailer")
    return [PackedChunk(bytes.fromhex(c[0]), c[1], c[2], c[3], c[4]) for c in doc["chunks"]]
