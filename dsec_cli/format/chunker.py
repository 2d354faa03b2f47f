"""Content-defined chunking with the compiled FastCDC chunker; boundaries reset at every
file. Only writers import this module (readers need `codec`, not the chunker).

Where `_cdc` is built (scripts/setup.sh), the cut points come from it: the same cut with
fastcdc's gear table, a window of the buffer per call and without the GIL, so compression
threads run while a large file is cut. Without it, fastcdc's own generator cuts."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from .index import ChunkParams

try:  # the compiled chunker; the package's pure-Python fallback is far too slow
    from fastcdc.const import TABLE as _GEAR_TABLE
    from fastcdc.fastcdc_cy import chunk_generator as _cdc_chunks
except ImportError as e:  # pragma: no cover - depends on the wheel
    raise ImportError("dsec needs fastcdc's compiled chunker (fastcdc.fastcdc_cy)") from e

try:
    from . import _cdc  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - built by scripts/setup.sh
    _cdc = None

_GEAR = array("I", _GEAR_TABLE).tobytes()


#: bytes cut per call of the compiled chunker: a large file is cut a window at a time, so
#: its first chunks go to the compression threads while the rest is still uncut
CUT_WINDOW = 8 << 20


def cut(data: memoryview, params: ChunkParams) -> Iterator[tuple[int, int]]:
    """(offset, length) of each content-defined chunk of one file's bytes."""
    if len(data) <= params.min_size:
        if len(data):
            yield 0, len(data)
        return
    if _cdc is None:
        for c in _cdc_chunks(data, params.min_size, params.avg_size, params.max_size, False,
                             None):
            yield c.offset, c.length
        return
    # a boundary depends only on the bytes since the previous one: every chunk of a window
    # but its last is final, and the last is cut again as the start of the next window
    window = max(CUT_WINDOW, 2 * params.max_size)
    off, end = 0, len(data)
    while off < end:
        stop = min(off + window, end)
        lengths = _cdc.lengths(data[off:stop], params.min_size, params.avg_size,
                               params.max_size, _GEAR)
        if stop < end:
            lengths = lengths[:-1]
        for ln in lengths:
            yield off, ln
            off += ln
