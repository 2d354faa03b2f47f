"""Content-defined chunking with the compiled FastCDC chunker; boundaries reset at every
file. Only writers import this module (readers need `codec`, not the chunker).

Where `_cdc` is built (setup.py), the cut points come from it: the same cut with
fastcdc's gear table, a window of the buffer per call and without the GIL, so compression
threads run while a large file is cut. Without it, fastcdc's own generator cuts."""

from __future__ import annotations

import importlib.util
import os
import threading
from array import array
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from .index import ChunkParams

try:
    from . import _cdc  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - built by setup.py
    _cdc = None


def _generator() -> Any:
    try:  # the compiled generator; the package's pure-Python fallback is far too slow
        from fastcdc.fastcdc_cy import chunk_generator
    except ImportError as e:  # pragma: no cover - depends on the wheel
        raise ImportError("dsec needs fastcdc's compiled chunker (fastcdc.fastcdc_cy)") from e
    return chunk_generator


def _gear_table() -> list[int]:
    """fastcdc's gear table, read from its `const` module alone where that module is a file:
    the package's ``__init__`` imports its command line (click), a tenth of a build's
    start-up. Elsewhere it is imported the usual way."""
    found = importlib.util.find_spec("fastcdc")
    where = found.submodule_search_locations if found else None
    if where:
        spec = importlib.util.spec_from_file_location("fastcdc.const",
                                                      Path(list(where)[0]) / "const.py")
        if spec is not None and spec.loader is not None and Path(spec.origin or "").is_file():
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return list(module.TABLE)
    from fastcdc.const import TABLE  # pragma: no cover - an installed package has the file

    return list(TABLE)


if _cdc is None:  # pragma: no cover - the generator is all there is: fail at import
    _generator()
_GEAR = array("I", _gear_table()).tobytes()


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
        for c in _generator()(data, params.min_size, params.avg_size, params.max_size,
                              False, None):
            yield c.offset, c.length
        return
    # a boundary depends only on the bytes since the previous one: every chunk of a window
    # but its last is final, and the last is cut again as the start of the next window. The
    # next window is cut on a thread of its own while this one's chunks are handed out, so
    # the caller's work on them (hashing, grouping) runs beside the cut, not after it
    window = max(CUT_WINDOW, 2 * params.max_size)
    end = len(data)

    def lengths_from(start: int) -> tuple[int, int, list[int]]:
        stop = min(start + window, end)
        return start, stop, _cdc.lengths(data[start:stop], params.min_size, params.avg_size,
                                         params.max_size, _GEAR)

    ahead: Future[tuple[int, int, list[int]]] | None = None
    try:
        off, stop, lengths = lengths_from(0)
        while True:
            if stop < end:
                lengths = lengths[:-1]
                ahead = _cut_pool().submit(lengths_from, off + sum(lengths))
            for ln in lengths:
                yield off, ln
                off += ln
            if ahead is None:
                return
            off, stop, lengths = ahead.result()
            ahead = None
    finally:
        if ahead is not None:  # the caller stopped early: the window's cut still reads data
            wait([ahead])


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child the pool's threads are gone: it starts a pool of its own."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _cut_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                       thread_name_prefix="dsec-cut")
        return _pool
