"""Chunk encoding. Readers dispatch on the codec stored with each chunk:

- ``0`` raw bytes (compression did not pay);
- ``1`` one zstd frame holding the chunk alone;
- ``2`` a member of a zstd *group*: up to `GROUP_BYTES` of neighbouring chunks compressed
  as one frame, so small and similar chunks share context (as in a solid archive) while a
  chunk is still read with one ranged read and decoded on its own.

A group's stored bytes are one 8-byte member header per chunk, then the frame::

    [uoff u32 | after u32] * n      member i: its offset in the decompressed group, and
                                    how many member headers follow its own
    zstd frame                      the n chunks' bytes, concatenated

Chunk i of a group is stored as the range from its own header to the end of the frame, so
``decode(2, stored, ulen)`` needs nothing but that range: it skips the headers after its own
and decompresses the frame only as far as ``uoff + ulen``. The chunks of a group share the
frame's bytes, so their ranges overlap (they all end where the frame ends).
"""

from __future__ import annotations

import struct
import threading

import zstandard

from ..core.errors import FormatError, IntegrityError

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_ZGROUP = 2
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZGROUP: "zstd-group"}

#: a writer closes a group once it holds this many uncompressed bytes (or GROUP_CHUNKS)
GROUP_BYTES = 1 << 20
GROUP_CHUNKS = 32
#: what a reader accepts: a group's decompressed bytes a member may reach into, and the
#: zstd window a group frame may ask for (a hostile frame cannot make a reader allocate more)
GROUP_MAX = 8 << 20
WINDOW_MAX = 8 << 20
MEMBER = struct.Struct("<II")

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


def _decompressor(group: bool = False) -> zstandard.ZstdDecompressor:
    name = "gdctx" if group else "dctx"
    d = getattr(_local, name, None)
    if d is None:
        d = zstandard.ZstdDecompressor(max_window_size=WINDOW_MAX) if group else \
            zstandard.ZstdDecompressor()
        setattr(_local, name, d)
    return d


def _zstd_unless_raw(data: bytes | memoryview, level: int) -> bytes | None:
    """One chunk's zstd frame, or None when compression does not pay (it is stored raw)."""
    z = _compressor(level).compress(data)
    return None if len(z) >= len(data) else z


def encode(data: bytes | memoryview, level: int) -> tuple[int, bytes]:
    """(codec, stored bytes) of one chunk on its own; raw when compression does not pay."""
    z = _zstd_unless_raw(data, level)
    return (CODEC_RAW, bytes(data)) if z is None else (CODEC_ZSTD, z)


def encode_group(payloads: list[bytes], level: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Neighbouring chunks stored together: (blob, [(codec, offset in blob, clen)] per chunk).

    Several chunks that compress become one group (codec 2); a lone chunk, or a set that does
    not compress or is larger than GROUP_MAX, is stored chunk by chunk as `encode` stores
    it."""
    parts, rows = encode_parts(b"".join(payloads), [len(p) for p in payloads], level)
    return b"".join(parts), rows


#: a piece of a chunk's (or group's) stored bytes, as `encode_parts` gives them
Piece = bytes | bytearray | memoryview


def encode_parts(data: bytes | bytearray | memoryview, lengths: list[int], level: int
                 ) -> tuple[list[Piece], list[tuple[int, int, int]]]:
    """`encode_group` of chunks given back to back in one buffer, ``lengths`` long each, the
    stored bytes left in pieces to be written one after the other (a group's member headers
    and its frame; each chunk stored alone), so that a writer's chunks are not copied again
    to join them. A raw chunk's piece is a view of ``data``, which must stay unchanged until
    the pieces are written."""
    # (a group past what readers accept, possible only with very large chunk parameters, is
    # stored chunk by chunk)
    n = len(lengths)
    if n > 1 and len(data) <= GROUP_MAX:
        frame = _compressor(level).compress(data)
        if len(frame) + MEMBER.size * n < len(data):
            heads, uoff = bytearray(), 0
            for i, ln in enumerate(lengths):
                heads += MEMBER.pack(uoff, n - 1 - i)
                uoff += ln
            size = len(heads) + len(frame)
            return [heads, frame], [(CODEC_ZGROUP, MEMBER.size * i, size - MEMBER.size * i)
                                    for i in range(n)]
        del frame  # not kept while the chunks are stored one by one
    # chunk by chunk, as `encode` stores each (raw when compression does not pay)
    view = memoryview(data)
    parts: list[Piece] = []
    rows, off, at = [], 0, 0
    for ln in lengths:
        piece = view[at:at + ln]
        at += ln
        z = _zstd_unless_raw(piece, level)
        stored, codec = (piece, CODEC_RAW) if z is None else (z, CODEC_ZSTD)
        parts.append(stored)
        rows.append((codec, off, len(stored)))
        off += len(stored)
    return parts, rows


def member(stored: bytes | memoryview) -> tuple[int, int]:
    """(offset of the chunk in its decompressed group, offset of the frame in ``stored``)
    of a codec-2 chunk's stored bytes; IntegrityError names what is out of bounds."""
    if len(stored) < MEMBER.size:
        raise IntegrityError(f"group member of {len(stored)} bytes has no header")
    uoff, after = MEMBER.unpack_from(stored)
    frame_at = MEMBER.size * (1 + after)
    if frame_at >= len(stored):
        raise IntegrityError(f"group member header says {after} more headers follow, past "
                             f"its {len(stored)} stored bytes")
    return uoff, frame_at


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
    if codec == CODEC_ZGROUP:
        return decode_group(stored, [ulen])[0]
    raise FormatError(f"unknown chunk codec {codec}; upgrade dsec")


def decode_group(stored: bytes | memoryview, ulens: list[int],
                 starts: list[int] | None = None) -> list[bytes]:
    """Chunks of one group from the stored range of its first wanted member: ``starts[k]`` is
    where member k's header is in ``stored`` (default: only the first, at 0). The frame is
    decompressed once, as far as the furthest member asked for."""
    view = memoryview(stored)
    where = starts or [0]
    spans = []
    frame_at = -1
    for at, ulen in zip(where, ulens, strict=True):
        uoff, fa = member(view[at:])
        if frame_at not in (-1, at + fa):
            raise IntegrityError("group members disagree on where their frame starts")
        frame_at = at + fa
        if uoff + ulen > GROUP_MAX:
            raise IntegrityError(f"group member reaches {uoff + ulen} bytes into its group, "
                                 f"past the limit of {GROUP_MAX}")
        spans.append((uoff, ulen))
    need = max(u + n for u, n in spans)
    try:
        reader = _decompressor(True).stream_reader(view[frame_at:], read_across_frames=False)
        out = bytearray()
        while len(out) < need:
            piece = reader.read(need - len(out))
            if not piece:
                break
            out += piece
    except zstandard.ZstdError as e:
        raise IntegrityError(f"chunk group does not decompress: {e}") from e
    if len(out) < need:
        raise IntegrityError(f"chunk group ends after {len(out)} bytes, before {need}")
    return [bytes(out[u:u + n]) for u, n in spans]
