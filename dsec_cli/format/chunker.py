"""Content-defined chunking with the compiled FastCDC chunker; boundaries reset at every
file. Only writers import this module (readers need `codec`, not the chunker).

Where `_cdc` is built (scripts/setup.sh), the cut points come from it: the same cut with
fastcdc's gear table, over the whole buffer without the GIL, so compression threads run
while a large file is cut. Without it, fastcdc's own generator cuts."""

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
    off = 0
    for ln in _cdc.lengths(data, params.min_size, params.avg_size, params.max_size, _GEAR):
        yield off, ln
        off += ln
