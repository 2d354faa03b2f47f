"""Build throughput, stored bytes, incremental dedup and no-op rebuild time on a real tree,
against `tar -c | zstd -T0 -3` and `casync make` on the same tree in the same run.

    python -m benchmarks build [--tree DIR] [--runs N] [--no-casync] [--python-walk] [--work DIR]

The tools take turns run after run (medians are reported). Each tool's CPU time (user + system,
all its processes) is printed beside its wall time: on a loaded machine the CPU ratio is the
steadier figure. With --python-walk dsec is also timed with
DSEC_PY_WALK=1 (the pure-Python walk and reader) in the same run. The no-op rebuild is split
into interpreter start, `dsec --help` (imports and the command-line framework) and the rest.

The tree is copied into a spec folder first (untimed) and read once so that every tool reads
from a warm page cache.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import dsec, du, save, sh, timed


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime



DEFAULT_TREES = ["/root/.pyenv/versions/3.11.7", "/usr/lib/python3", "/usr/lib/x86_64-linux-gnu"]


def _store_bytes(store: Path) -> int:
    return sum(du(store / k) for k in ("packs", "indexes", "manifests") if (store / k).exists())


def _change_one_percent(tree: Path) -> int:
    files = sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()
                   and p.stat().st_size > 0)
    changed = files[::100]
    for p in changed:
        data = bytearray(p.read_bytes())
        mid = len(data) // 2
        data[mid:mid] = b"# a small edit in the middle of the file\n"
        os.chmod(p, 0o644)
        p.write_bytes(bytes(data))
    return len(changed)


def _no_nan(obj: Any) -> Any:
    """What was not measured is null in the results file (JSON has no NaN)."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_no_nan(v) for v in obj]
    return obj


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks build")
    ap.add_argument("--tree", default=next((t for t in DEFAULT_TREES if Path(t).is_dir()), None))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-casync", action="store_true", help="skip the casync peer")
    ap.add_argument("--python-walk", action="store_true",
                    help="also time dsec with DSEC_PY_WALK=1 (the pure-Python walk)")
    ap.add_argument("--label", default="",
                    help="results go to benchmarks/results/build[-LABEL].json")
    ap.add_argument("--work", default="/var/tmp",
                    help="where the tree is copied and the stores are written (/dev/shm keeps "
                         "the tree in memory while other work drops the page cache)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-build-", dir=args.work))
    try:
        run(Path(args.tree), args.runs, work, args.label, casync=not args.no_casync,
            python_walk=args.python_walk)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(src: Path, runs: int, work: Path, label: str = "", *, casync: bool = True,
        python_walk: bool = False) -> None:
    spec = work / "spec"
    spec.mkdir()
    sh(f"cp -a {src} {spec}/tree")
    (spec / "env.yaml").write_text('layer: env\nversion: "1"\nsteps:\n'
                                   "  - copy: {src: ./tree, dst: /env}\n")
    tree = spec / "tree"
    size = du(tree)
    nfiles = int(sh(f"find {tree} -type f | wc -l").stdout)
    sh(f"tar -C {tree} -cf - . > /dev/null")  # warm the page cache
    print(f"tree: {src} ({size / 1e6:.0f} MB in {nfiles} files), {runs} runs each")

    tz = work / "t.tar.zst"
    cas = work / "castr"
    store = work / "store"
    n = {"i": 0}

    def fresh() -> None:
        shutil.rmtree(store, ignore_errors=True)
        n["i"] += 1

    def build(extra: dict[str, str] | None = None) -> None:
        dsec("build", str(spec), "--store", str(store),
             env={"DSEC_DATA_DIR": str(work / f"data{n['i']}"), **(extra or {})})

    # the tools take turns, run after run, so that a change in the machine's load falls on
    # all of them alike
    tools: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
        "tar_zstd": (lambda: sh(f"tar -C {tree} -cf - . | zstd -T0 -3 -q -f -o {tz}"), None)}
    if casync:
        tools["casync"] = (lambda: sh(f"casync make --store={cas} {work}/c.caidx {tree}"),
                           lambda: shutil.rmtree(cas, ignore_errors=True))
    if python_walk:
        tools["dsec_python_walk"] = (lambda: build({"DSEC_PY_WALK": "1"}), fresh)
    tools["dsec"] = (build, fresh)  # last: the store it leaves is measured below
    walls: dict[str, list[float]] = {k: [] for k in tools}
    cpus: dict[str, list[float]] = {k: [] for k in tools}
    for _ in range(runs):
        for name, (fn, setup) in tools.items():
            if setup:
                setup()
            before, t = _child_cpu(), time.perf_counter()
            fn()
            walls[name].append(time.perf_counter() - t)
            cpus[name].append(_child_cpu() - before)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    nan = float("nan")
    t_tar, c_tar = wall["tar_zstd"], cpu["tar_zstd"]
    t_cas, t_py, c_py = wall.get("casync", nan), wall.get("dsec_python_walk", nan), \
        cpu.get("dsec_python_walk", nan)
    t_dsec, c_dsec = wall["dsec"], cpu["dsec"]
    tar_zst = tz.stat().st_size
    cas_bytes = du(cas) if casync else 0
    stored = _store_bytes(store)
    for name, out_bytes in (("tar_zstd", tar_zst), ("casync", cas_bytes),
                            ("dsec_python_walk", 0), ("dsec", stored)):
        if name in wall:
            print(f"{name:17} {wall[name]:6.2f}s (cpu {cpu[name]:.2f}s)  "
                  f"{size / wall[name] / 1e6:4.0f} MB/s  {out_bytes / 1e6:.1f} MB  "
                  f"runs {', '.join(f'{x:.2f}' for x in walls[name])}")

    data_dir = {"DSEC_DATA_DIR": str(work / f"data{n['i']}")}
    t_noop, noop_runs = timed(lambda: dsec("build", str(spec), "--store", str(store),
                                           env=data_dir), 5)
    t_start, _ = timed(lambda: sh(f"{sys.executable} -c pass"), 5)
    t_help, _ = timed(lambda: dsec("--help"), 5)
    print(f"no-op rebuild:   {t_noop:.2f}s (median of 5, whole CLI process): interpreter "
          f"{t_start:.2f}s, `dsec --help` {t_help:.2f}s, the build's own work "
          f"{t_noop - t_help:.2f}s")

    spec2 = work / "spec2"
    sh(f"cp -a {spec} {spec2}")
    changed = _change_one_percent(spec2 / "tree")
    (spec2 / "env.yaml").write_text((spec2 / "env.yaml").read_text().replace('"1"', '"2"'))
    before = _store_bytes(store)
    dsec("build", str(spec2), "--store", str(store), env=data_dir)
    new = _store_bytes(store) - before
    print(f"1% change ({changed} files): {new / 1e6:.2f} MB new = {new / stored:.2%} of v1")

    ratios = {
        "throughput_vs_tar_zstd": t_tar / t_dsec,
        "cpu_vs_tar_zstd": c_tar / c_dsec,
        "throughput_vs_casync": t_cas / t_dsec,
        "compiled_vs_python_walk": t_py / t_dsec,
        "stored_vs_tar_zst": stored / tar_zst,
        "new_bytes_for_1pct_change": new / stored,
        "noop_rebuild_seconds": t_noop,
    }
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    out = save(f"build-{label}" if label else "build", _no_nan({
        "tree": str(src), "tree_bytes": size, "files": nfiles, "runs": runs,
        "seconds": {"tar_zstd": t_tar, "casync": t_cas, "dsec": t_dsec, "noop": t_noop,
                    "noop_runs": noop_runs, "dsec_python_walk": t_py, "interpreter": t_start,
                    "dsec_help": t_help},
        "cpu_seconds": {"tar_zstd": c_tar, "dsec": c_dsec, "dsec_python_walk": c_py},
        "run_seconds": walls, "run_cpu_seconds": cpus,
        "bytes": {"tar_zst": tar_zst, "casync_store": cas_bytes, "dsec_store": stored,
                  "dsec_new_after_1pct": new},
        "changed_files": changed, "ratios": ratios, "work_dir": str(work.parent),
        "load_average_at_end": list(os.getloadavg()),
    }))
    print(f"results: {out}")
