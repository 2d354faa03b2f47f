"""Helpers for benchmarks: timing with medians, running peers, writing results."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]


def timed(fn: Callable[[], Any], runs: int, setup: Callable[[], Any] | None = None
          ) -> tuple[float, list[float]]:
    """Median wall time of fn over runs (setup, untimed, before each run)."""
    times = []
    for _ in range(runs):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def sh(cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], check=True, capture_output=True, text=True, **kw)


def dsec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsec_cli", *args], check=True,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def du(path: Path) -> int:
    """Bytes of regular files under path (apparent sizes)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    data = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **data}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    return out


def drop_caches() -> None:
    """Cold page cache where allowed (root); a no-op elsewhere."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass
