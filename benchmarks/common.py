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


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def samples(fn: Callable[[], object], n: int) -> list[float]:
    """The wall time of each of n runs of fn."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def busybox_node(prefix: str, config: bool = False) -> Path:
    """A new temporary directory holding this process's node (DSEC_STATE_DIR) and a file
    store (DSEC_STORE) with the busybox layer built into it; ``config``: a fresh user config
    too. Returns the directory."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.update({"DSEC_STATE_DIR": str(tmp / "node"),
                       "DSEC_STORE": (tmp / "store").as_uri(), "XDG_DATA_HOME": str(tmp / "data")})
    if config:
        os.environ["XDG_CONFIG_HOME"] = str(tmp / "cfg")
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    from dsec_cli.build.builder import build

    build([REPO / "layerspecs/busybox/busybox.yaml"], os.environ["DSEC_STORE"])
    return tmp
