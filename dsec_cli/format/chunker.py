"""Content-defined chunking with the compiled FastCDC chunker; boundaries reset at every
file. Only writers import this module (readers need `codec`, not the chunker)."""

from __future__ import annotations

from collections.abc import Iterator

from .index import ChunkParams

try:  # the compiled chunker; the package's pure-Python fallback is far too slow
    from fastcdc.fastcdc_cy import chunk_generator as _cdc_chunks
except ImportError as e:  # pragma: no cover - depends on the wheel
    raise ImportError("dsec needs fastcdc's compiled chunker (fastcdc.fastcdc_cy)") from e


def cut(data: memoryview, params: ChunkParams) -> Iterator[tuple[int, int]]:
    """(offset, length) of each content-defined chunk of one file's bytes."""
    if len(data) <= params.min_size:
        if len(data):
            yield 0, len(data)
        return
    for c in _cdc_chunks(data, params.min_size, params.avg_size, params.max_size, False, None):
        yield c.offset, c.length
