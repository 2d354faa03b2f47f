"""Helpers for benchmarks: timing with medians, running peers, writing results, and a node's
run with a swap file made for it and everything removed after."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


# -- a node's run: swap made for it, everything removed after ------------------------------------
GiB = 1 << 30


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    from dsec_cli.run.density import _meminfo

    return _meminfo()


def swap_for_run(where: Path, size: int, reserve: int = 2 * GiB) -> Path | None:
    """A swap file of ``size`` bytes under ``where`` unless the host already has that much
    swap free (None then; a smaller swap someone else may turn off is not relied on).
    Refuses (SystemExit naming the figures) where the filesystem has less than ``size`` plus
    ``reserve`` free: a full disk would stop everything else on the host."""
    if meminfo().get("SwapFree", 0) >= size:
        return None
    free = shutil.disk_usage(where).free
    if free < size + reserve:
        raise SystemExit(f"a swap file of {size / GiB:.1f} GiB is needed for this run but "
                         f"{where} has {free / GiB:.1f} GiB free (keeping {reserve / GiB:.0f} "
                         "GiB spare): free disk space, add swap, or run fewer sandboxes")
    from dsec_cli.run import density

    path = where / "bench.swap"
    density.add_swap(path, size)
    return path


def remove_sandboxes(workers: int = 4) -> int:
    """Remove every sandbox of this process's node (DSEC_STATE_DIR); returns how many."""
    from concurrent.futures import ThreadPoolExecutor

    from dsec_cli.run.node import Node

    node = Node()
    ids = [r.id for r in node.db.all()]

    def rm(sid: str) -> None:
        try:
            node.remove(sid)
        except Exception as e:  # the rest are still removed; what failed is said
            print(f"could not remove sandbox {sid}: {e}", file=sys.stderr)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(rm, ids))
    return len(ids)


def remove_swap(path: Path) -> None:
    """Turn off and delete a swap file made by `swap_for_run`, unless what it still holds
    would not fit in RAM (swapoff would then push the host into the OOM killer): that is
    said, and the file left on."""
    from dsec_cli.run import density

    used = 0
    with open("/proc/swaps") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            if cols and cols[0] == str(path):
                used = int(cols[3]) << 10
    if used and used + GiB > meminfo().get("MemAvailable", 0):
        print(f"swap file {path} still holds {used / GiB:.1f} GiB, more than RAM has free: "
              f"left on (`swapoff {path} && rm {path}` once its sandboxes are gone)",
              file=sys.stderr)
        return
    density.remove_swap(path)


@contextmanager
def node_run(tmp: Path, swap: int = 0) -> Iterator[Path | None]:
    """The body runs with a swap file of ``swap`` bytes made for it unless the host has that
    much swap free (the file yielded; None otherwise); afterwards, also on an exception, Ctrl-C or SIGTERM, every
    sandbox of the node is removed, then the swap file, then ``tmp``. A second Ctrl-C does
    not interrupt the clean-up."""
    import signal

    def term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, term)
    path = None
    try:
        if swap:
            path = swap_for_run(tmp, swap)
        yield path
    finally:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            n = remove_sandboxes()
            if n:
                print(f"removed {n} sandboxes", file=sys.stderr)
            if path is not None:
                remove_swap(path)
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
