"""asyncio SDK benchmark (on demand, as root): `AsyncSandbox` next to `Sandbox`, in one run.

    .venv/bin/python -m benchmarks aio [--n 64] [--rounds 200]

Measures the warm exec round trip (`true`, one fncall sandbox, sequential) through both
APIs, and N execs at once across N fncall sandboxes: wall time and the process's peak
thread count, asyncio (`asyncio.gather`) against the threaded API (one thread per exec).
Writes benchmarks/results/aio.json and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import busybox_node  # noqa: E402

IMAGE = "busybox@1.35-1"


class PeakThreads:
    """Samples threading.active_count() every millisecond while in use."""

    def __enter__(self) -> PeakThreads:
        self.peak, self._stop = threading.active_count(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, threading.active_count() - 1)  # not the sampler

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks aio")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    tmp = busybox_node("dsec-bench-aio-")
    try:
        result = asyncio.run(_run(args.n, args.rounds))
    finally:
        from dsec_cli.run.node import Node

        node = Node()
        for r in node.db.all():
            node.remove(r.id)
        node.gc(budget=0)
        shutil.rmtree(tmp, ignore_errors=True)
    out = REPO / "benchmarks/results/aio.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


async def _run(n: int, rounds: int) -> dict[str, object]:
    from dsec_cli.api.aio import AsyncSandbox, close_sessions
    from dsec_cli.api.sandboxes import Sandbox

    boxes = await asyncio.gather(*(AsyncSandbox.create(IMAGE, "fncall") for _ in range(n)))
    syncs = [Sandbox.attach(b.id) for b in boxes]
    try:
        # asyncio first, before the threaded API has opened its connections (each has a
        # reader thread, which would count in the asyncio phase's peak)
        for b in boxes:
            await b.exec(["true"])
        base = threading.active_count()
        with PeakThreads() as ap:
            t0 = time.perf_counter()
            await asyncio.gather(*(b.exec(["true"]) for b in boxes))
            a_wall = time.perf_counter() - t0
        with ThreadPoolExecutor(n) as pool:  # warm every threaded connection
            list(pool.map(lambda s: s.exec(["true"]), syncs))
        with PeakThreads() as sp, ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda s: s.exec(["true"]), syncs))
            s_wall = time.perf_counter() - t0
        a_rt, s_rt = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await boxes[0].exec(["true"])
            a_rt.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            syncs[0].exec(["true"])
            s_rt.append(time.perf_counter() - t0)
        return {
            "sandboxes": n, "rounds": rounds,
            "warm_exec_ms_p50": {"async": round(statistics.median(a_rt) * 1e3, 2),
                                 "sync": round(statistics.median(s_rt) * 1e3, 2)},
            "threads_before": base,
            "concurrent_execs": {"async": {"wall_ms": round(a_wall * 1e3, 1),
                                           "peak_threads": ap.peak},
                                 "sync_thread_per_exec": {"wall_ms": round(s_wall * 1e3, 1),
                                                          "peak_threads": sp.peak}},
        }
    finally:
        await asyncio.gather(*(b.remove() for b in boxes))
        await close_sessions()


if __name__ == "__main__":
    main()
