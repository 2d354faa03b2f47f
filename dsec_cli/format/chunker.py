"""Content-defined chunking (FastCDC, compiled) and chunk encoding (per-chunk zstd).

Boundaries reset at every file. Each chunk is identified by the xxh3-128 of its
uncompressed bytes and compressed on its own, so it can be fetched and decoded alone.
The codec is stored per chunk, and readers dispatch on it (raw for incompressible data).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard

from ..core.errors import FormatError, IntegrityError

try:  # the compiled chunker; the package's pure-Python fallback is far too slow
    from fastcdc.fastcdc_cy import chunk_generator as _cdc_chunks
except ImportError as e:  # pragma: no cover - depends on the wheel
    raise ImportError("dsec needs fastcdc's compiled chunker (fastcdc.fastcdc_cy)") from e

CODEC_RAW = 0
CODEC_ZSTD = 1
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}


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


def cut(data: memoryview, params: ChunkParams) -> Iterator[tuple[int, int]]:
    """(offset, length) of each content-defined chunk of one file's bytes."""
    if len(data) <= params.min_size:
        if len(data):
            yield 0, len(data)
        return
    for c in _cdc_chunks(data, params.min_size, params.avg_size, params.max_size, False, None):
        yield c.offset, c.length


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    comps = getattr(_local, "comps", None)
    if comps is None:
        comps = _local.comps = {}
    c = comps.get(level)
    if c is None:
        # no content size / checksum in the frame: the index has both, and xxh3 verifies
        c = comps[level] = zstandard.ZstdCompressor(level=level, write_content_size=False,
                                                    write_checksum=False)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def encode(data: bytes | memoryview, level: int) -> tuple[int, bytes]:
    """(codec, stored bytes); raw when compression does not pay."""
    z = _compressor(level).compress(data)
    if len(z) >= len(data):
        return CODEC_RAW, bytes(data)
    return CODEC_ZSTD, z


def decode(codec: int, stored: bytes | memoryview, ulen: int) -> bytes:
    if codec == CODEC_RAW:
        return bytes(stored)
    if codec == CODEC_ZSTD:
        try:
            return _decompressor().decompress(stored, max_output_size=ulen)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"chunk does not decompress: {e}") from e
    raise FormatError(f"unknown chunk codec {codec}; upgrade dsec")
