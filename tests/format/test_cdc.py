"""The compiled cut (format/_cdc.c) cuts every input where fastcdc's own chunker does, for
the default chunk parameters and others, on random, repetitive and real bytes, and does it
with the GIL released. The extension is compiled here from its source."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from fastcdc.fastcdc_cy import chunk_generator

from dsec_cli.format import chunker
from dsec_cli.format.index import ChunkParams
from tests.cext import build_and_load

SRC = Path(chunker.__file__).with_name("_cdc.c")
PARAMS = [ChunkParams(), ChunkParams(min_size=64, avg_size=256, max_size=1024),
          ChunkParams(min_size=2048, avg_size=8192, max_size=65536),
          ChunkParams(min_size=100_000, avg_size=65536, max_size=200_000),  # min over avg
          ChunkParams(min_size=1 << 20, avg_size=4 << 20, max_size=16 << 20)]


@pytest.fixture(scope="module")
def cdc(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return build_and_load(SRC, tmp_path_factory.mktemp("cdc"))


def _reference(data: bytes, p: ChunkParams) -> list[tuple[int, int]]:
    return [(c.offset, c.length) for c in chunk_generator(
        memoryview(data), p.min_size, p.avg_size, p.max_size, False, None)]


def _inputs() -> list[bytes]:
    rng = random.Random(7)
    real = Path(sys.executable).resolve().read_bytes()[:3 << 20]  # an ELF binary
    text = b"".join(p.read_bytes() for p in sorted(Path(random.__file__).parent.glob("*.py"))[:60])
    return [rng.randbytes(5 << 20), bytes(3 << 20), b"ab" * (1 << 20), real, text,
            rng.randbytes(65_537), rng.randbytes(16_385)]


@pytest.mark.parametrize("window", [chunker.CUT_WINDOW, 1 << 20, 0],
                         ids=["whole", "1MiB-windows", "smallest-windows"])
@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"{p.min_size}-{p.avg_size}-{p.max_size}")
def test_compiled_cut_matches_fastcdc(cdc: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                      p: ChunkParams, window: int) -> None:
    """Cut a window at a time (the last chunk of each window cut again with the next), the
    chunks are those of one cut over the whole buffer."""
    monkeypatch.setattr(chunker, "_cdc", cdc)
    monkeypatch.setattr(chunker, "CUT_WINDOW", window)
    for data in _inputs():
        got = list(chunker.cut(memoryview(data), p))
        want = _reference(data, p) if len(data) > p.min_size else [(0, len(data))]
        assert got == want, (len(data), p)
        assert sum(n for _, n in got) == len(data)


def test_fallback_cuts_alike(cdc: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the compiled module the generator cuts: the same (offset, length) pairs as
    the compiled cut, end to end over the whole buffer."""
    data = random.Random(3).randbytes(2 << 20)
    p = ChunkParams()
    monkeypatch.setattr(chunker, "_cdc", cdc)
    compiled = list(chunker.cut(memoryview(data), p))
    monkeypatch.setattr(chunker, "_cdc", None)
    fallback = list(chunker.cut(memoryview(data), p))
    assert fallback == compiled and len(fallback) > 1
    assert [o for o, _ in fallback] == [sum(n for _, n in fallback[:i])
                                        for i in range(len(fallback))]
    assert sum(n for _, n in fallback) == len(data)


@pytest.mark.parametrize("warm", [1, 2, 8])
@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"{p.min_size}-{p.avg_size}-{p.max_size}")
def test_a_second_lane_started_cold_is_scanned_again(cdc: ModuleType, p: ChunkParams,
                                                     warm: int) -> None:
    """The cut scans a range as two lanes, the second started a few bytes early. Started
    only 1, 2 or 8 bytes early, that lane's hash is not yet the exact one: its half must be
    scanned again, and every cut point is still fastcdc's (trusting the lane would move
    them)."""
    for data in _inputs():
        if len(data) <= p.min_size:
            continue
        got = cdc.lengths(data, p.min_size, p.avg_size, p.max_size, chunker._GEAR, warm)
        assert got == [n for _, n in _reference(data, p)], (len(data), p, warm)


def test_a_cut_stopped_early_leaves_no_window_being_read(cdc: ModuleType,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The next window is cut on another thread while the caller takes this one's chunks;
    a caller that stops early gets its buffer back free (while a cut still reads it, a
    bytearray cannot be resized, nor an mmap closed)."""
    monkeypatch.setattr(chunker, "_cdc", cdc)
    monkeypatch.setattr(chunker, "CUT_WINDOW", 32 << 20)
    data = bytearray(random.Random(5).randbytes(80 << 20))
    for _ in range(3):
        view = memoryview(data)
        chunks = chunker.cut(view, ChunkParams())
        assert next(chunks)[0] == 0
        time.sleep(0.003)  # the next window's cut (some 15 ms) has begun
        chunks.close()
        view.release()
        data.append(0)  # BufferError while a slice of it is being cut elsewhere
        del data[-1]


def test_a_forked_child_cuts_with_a_pool_of_its_own(cdc: ModuleType,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The windows are cut on a thread pool; a child forked after it started has none of its
    threads, so it must start its own (with the parent's pool it would wait forever). The
    child is killed if it has not finished within 30 s."""
    import signal

    monkeypatch.setattr(chunker, "_cdc", cdc)
    monkeypatch.setattr(chunker, "CUT_WINDOW", 1 << 20)
    data = random.Random(9).randbytes(4 << 20)
    want = list(chunker.cut(memoryview(data), ChunkParams()))  # the pool is running now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os._exit(0 if list(chunker.cut(memoryview(data), ChunkParams())) == want else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's cut did not finish within 30 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_bad_arguments_are_refused(cdc: ModuleType) -> None:
    with pytest.raises(ValueError, match="gear table"):
        cdc.lengths(b"x" * 100_000, 16384, 65536, 262144, b"short")
    with pytest.raises(ValueError, match="out of range"):
        cdc.lengths(b"x" * 100_000, 1, 65536, 262144, chunker._GEAR)
    for warm in (0, 65):
        with pytest.raises(ValueError, match="warm"):
            cdc.lengths(b"x" * 100_000, 16384, 65536, 262144, chunker._GEAR, warm)


def test_cut_runs_without_the_gil(cdc: ModuleType) -> None:
    """Another thread keeps running Python while one long buffer is cut: the longest pause
    in its ticks during the cut is a small part of the cut (with the GIL held, it would be
    the whole cut)."""
    data = os.urandom(16 << 20) * 16
    ticks: list[float] = []
    done = threading.Event()

    def count() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=count)
    t.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        cdc.lengths(data, 16384, 65536, 262144, chunker._GEAR)
        end = time.perf_counter()
    finally:
        done.set()
        t.join()
    inside = [x for x in ticks if start <= x <= end]
    pauses = [b - a for a, b in zip([start, *inside], [*inside, end], strict=True)]
    assert max(pauses) < (end - start) / 2, (max(pauses), end - start, len(inside))


def test_the_gear_table_is_fastcdcs() -> None:
    """The table read from fastcdc's `const` module alone is the one its package exports."""
    from array import array

    from fastcdc.const import TABLE

    assert chunker._GEAR == array("I", TABLE).tobytes() and len(chunker._GEAR) == 1024
