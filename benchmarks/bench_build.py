"""Build throughput, stored bytes, incremental dedup and no-op rebuild time on a real tree,
against `tar -c | zstd -T0 -3` and `casync make` on the same tree in the same run.

    python -m benchmarks build [--tree DIR] [--runs N]

The tree is copied into a spec folder first (untimed) and read once so that every tool reads
from a warm page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from .common import dsec, du, save, sh, timed

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


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks build")
    ap.add_argument("--tree", default=next((t for t in DEFAULT_TREES if Path(t).is_dir()), None))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", default="",
                    help="results go to benchmarks/results/build[-LABEL].json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-build-", dir="/var/tmp"))
    try:
        run(Path(args.tree), args.runs, work, args.label)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(src: Path, runs: int, work: Path, label: str = "") -> None:
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
    t_tar, _ = timed(lambda: sh(f"tar -C {tree} -cf - . | zstd -T0 -3 -q -f -o {tz}"), runs)
    tar_zst = tz.stat().st_size
    print(f"tar|zstd -T0 -3: {t_tar:.2f}s  {size / t_tar / 1e6:.0f} MB/s  {tar_zst / 1e6:.1f} MB")

    cas = work / "castr"
    t_cas, _ = timed(lambda: sh(f"casync make --store={cas} {work}/c.caidx {tree}"), runs,
                     setup=lambda: shutil.rmtree(cas, ignore_errors=True))
    cas_bytes = du(cas)
    print(f"casync make:     {t_cas:.2f}s  {size / t_cas / 1e6:.0f} MB/s  {cas_bytes / 1e6:.1f} MB")

    store = work / "store"
    n = {"i": 0}

    def fresh() -> None:
        shutil.rmtree(store, ignore_errors=True)
        n["i"] += 1

    def build() -> None:
        dsec("build", str(spec), "--store", str(store),
             env={"DSEC_DATA_DIR": str(work / f"data{n['i']}")})

    t_dsec, _ = timed(build, runs, setup=fresh)
    stored = _store_bytes(store)
    print(f"dsec build:      {t_dsec:.2f}s  {size / t_dsec / 1e6:.0f} MB/s  {stored / 1e6:.1f} MB")

    data_dir = {"DSEC_DATA_DIR": str(work / f"data{n['i']}")}
    t_noop, noop_runs = timed(lambda: dsec("build", str(spec), "--store", str(store),
                                           env=data_dir), 5)
    print(f"no-op rebuild:   {t_noop:.2f}s (median of 5, whole CLI process)")

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
        "throughput_vs_casync": t_cas / t_dsec,
        "stored_vs_tar_zst": stored / tar_zst,
        "new_bytes_for_1pct_change": new / stored,
        "noop_rebuild_seconds": t_noop,
    }
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    out = save(f"build-{label}" if label else "build", {
        "tree": str(src), "tree_bytes": size, "files": nfiles, "runs": runs,
        "seconds": {"tar_zstd": t_tar, "casync": t_cas, "dsec": t_dsec, "noop": t_noop,
                    "noop_runs": noop_runs},
        "bytes": {"tar_zst": tar_zst, "casync_store": cas_bytes, "dsec_store": stored,
                  "dsec_new_after_1pct": new},
        "changed_files": changed, "ratios": ratios,
    })
    print(f"results: {out}")
