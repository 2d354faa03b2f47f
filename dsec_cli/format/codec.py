"""Chunk encoding: each chunk is compressed on its own (zstd) so it can be fetched and
decoded alone; the codec is stored per chunk and readers dispatch on it."""

from __future__ import annotations

import threading

import zstandard

from ..core.errors import FormatError, IntegrityError

CODEC_RAW = 0
CODEC_ZSTD = 1
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}


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
            # zstandard trusts a frame's declared size over max_output_size: a frame that
            # declares more than the index's ulen is refused before anything is allocated
            declared = zstandard.frame_content_size(stored)
            if declared > ulen:
                raise IntegrityError(f"chunk frame declares {declared} bytes, more than its "
                                     f"ulen {ulen}")
            return _decompressor().decompress(stored, max_output_size=ulen)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"chunk does not decompress: {e}") from e
    raise FormatError(f"unknown chunk codec {codec}; upgrade dsec")
