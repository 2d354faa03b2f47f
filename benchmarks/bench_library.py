"""Library size: a store of related environments (several versions of the same Python
packages, snapshots of one repository at several commits) against one `tar | zstd -3` per
layer, restic and casync on the same library, in the same run.

    python -m benchmarks library [--work DIR] [--runs N] [--no-restic] [--no-casync]

Each environment is one layer, built oldest first into one store (`dsec build` of a spec
with one `copy` step), so that later versions deduplicate against earlier ones. dsec is
built twice: as it is (new chunks compressed in 1 MiB groups, format/codec.py) and with one
zstd frame per chunk (how format 1 stored every chunk), so the size and build time before
and after the change are measured side by side. restic backs every environment up into one
repository (compression on, repository version 2), casync makes every environment into one
chunk store. Sizes are the bytes of the stores' files. The two dsec builds take turns, run
after run (medians of --runs are reported, with CPU time: user + system of all processes).

The package versions are installed from PyPI into separate directories (`pip install
--target`, no dependencies), once, into the work directory; the repository snapshots are
`git archive` of this checkout at the 1st, 41st, 121st and 301st commits back from HEAD
(`git rev-list` order; those that exist).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import REPO, du, save, sh

PACKAGES = [("django", ["4.2.0", "4.2.10", "5.0.1"]), ("numpy", ["1.26.3", "1.26.4"])]
COMMITS = [300, 120, 40, 0]  # oldest first

#: dsec with one zstd frame per chunk (format 1's encoding), for the "before" column
ONE_FRAME = ("import sys, runpy; import dsec_cli.build.layer as l; l.GROUP_CHUNKS = 1; "
             "sys.argv[0] = 'dsec'; runpy.run_module('dsec_cli', run_name='__main__')")


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def library(work: Path) -> list[tuple[str, str, Path]]:
    """(name, version, tree) of each environment, oldest first."""
    src = work / "src"
    out: list[tuple[str, str, Path]] = []
    for name, versions in PACKAGES:
        for v in versions:
            d = src / f"{name}-{v}"
            if not d.is_dir():
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                "--target", str(d), f"{name}=={v}"], check=True)
            out.append((name, v, d))
    history = sh(f"git -C {REPO} rev-list HEAD").stdout.split()
    for back in COMMITS:
        if back >= len(history):
            continue
        d = src / f"repo-{back}"
        if not d.is_dir():
            d.mkdir(parents=True)
            sh(f"git -C {REPO} archive {history[back]} | tar -x -C {d}")
        out.append(("repo", str(back), d))
    return out


def _specs(work: Path, envs: list[tuple[str, str, Path]]) -> list[Path]:
    specs = []
    for name, v, tree in envs:
        spec = work / "specs" / f"{name}-{v}"
        if not spec.is_dir():
            spec.mkdir(parents=True)
            sh(f"cp -a {tree} {spec}/tree")
            (spec / "layer.yaml").write_text(f'layer: {name}\nversion: "{v}"\nsteps:\n'
                                             "  - copy: {src: ./tree, dst: /env}\n")
        specs.append(spec)
    return specs


def _dsec_build(specs: list[Path], store: Path, data: Path, one_frame: bool
                ) -> tuple[float, float]:
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(data, ignore_errors=True)
    env = {**os.environ, "DSEC_DATA_DIR": str(data), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", ONE_FRAME] if one_frame else [sys.executable, "-m",
                                                                "dsec_cli"]
    cpu, t = _cpu(), time.perf_counter()
    for spec in specs:
        subprocess.run([*argv, "build", str(spec), "--store", str(store)], check=True,
                       capture_output=True, env=env)
    return time.perf_counter() - t, _cpu() - cpu


def _store_bytes(store: Path) -> int:
    return sum(du(store / k) for k in ("packs", "indexes", "manifests") if (store / k).exists())


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks library")
    ap.add_argument("--work", default="/var/tmp/dsec-bench-library",
                    help="kept between runs: the installed packages are reused")
    ap.add_argument("--runs", type=int, default=3, help="builds of each dsec variant")
    ap.add_argument("--no-restic", action="store_true")
    ap.add_argument("--no-casync", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.work)
    envs = library(work)
    specs = _specs(work, envs)
    tree_bytes = sum(du(t) for _, _, t in envs)
    print(f"library: {len(envs)} environments, {tree_bytes / 1e6:.0f} MB: "
          + ", ".join(f"{n}@{v}" for n, v, _ in envs))

    tar_zst = {f"{n}@{v}": int(sh(f"tar -C {t} -cf - . | zstd -3 -q -c | wc -c").stdout)
               for n, v, t in envs}
    tar_total = sum(tar_zst.values())

    sizes: dict[str, int] = {}
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.runs):  # turns, so a change in the machine's load falls on both
        for label, one in (("dsec_one_frame_per_chunk", True), ("dsec", False)):
            runs.setdefault(label, []).append(_dsec_build(
                specs, work / f"store-{label}", work / f"data-{label}", one))
            sizes[label] = _store_bytes(work / f"store-{label}")
    for label, rs in runs.items():
        seconds[label] = statistics.median(r[0] for r in rs)
        cpu[label] = statistics.median(r[1] for r in rs)
        print(f"{label}: runs {', '.join(f'{w:.1f}s (cpu {c:.1f}s)' for w, c in rs)}")

    if not args.no_restic and shutil.which("restic"):
        repo = work / "restic"
        shutil.rmtree(repo, ignore_errors=True)
        env = {**os.environ, "RESTIC_PASSWORD": "bench", "RESTIC_REPOSITORY": str(repo)}
        subprocess.run(["restic", "init", "--repository-version", "2"], check=True,
                       capture_output=True, env=env)
        c, t = _cpu(), time.perf_counter()
        for _, _, tree in envs:
            subprocess.run(["restic", "backup", "-q", "."], cwd=tree, check=True,
                           capture_output=True, env=env)
        seconds["restic"], cpu["restic"] = time.perf_counter() - t, _cpu() - c
        sizes["restic"] = du(repo)
    elif not args.no_restic:
        print("restic: not installed (apt-get install restic), skipped")

    if not args.no_casync and shutil.which("casync"):
        cas = work / "casync"
        shutil.rmtree(cas, ignore_errors=True)
        (cas / "idx").mkdir(parents=True)
        c, t = _cpu(), time.perf_counter()
        for n, v, tree in envs:
            sh(f"casync make --store={cas}/store {cas}/idx/{n}-{v}.caidx {tree}")
        seconds["casync"], cpu["casync"] = time.perf_counter() - t, _cpu() - c
        sizes["casync"] = du(cas)
    elif not args.no_casync:
        print("casync: not installed (apt-get install casync), skipped")

    print(f"{'per-layer tar | zstd -3':28} {tar_total / 1e6:8.1f} MB   1.000")
    for k, v in sizes.items():
        t = f"  build {seconds[k]:6.1f}s (cpu {cpu[k]:.1f}s)" if k in seconds else ""
        print(f"{k:28} {v / 1e6:8.1f} MB   {v / tar_total:.3f}{t}")
    ratios = {f"{k}_vs_tar_zstd": v / tar_total for k, v in sizes.items()}
    ratios["dsec_vs_one_frame_per_chunk"] = sizes["dsec"] / sizes["dsec_one_frame_per_chunk"]
    ratios["build_cpu_vs_one_frame_per_chunk"] = cpu["dsec"] / cpu["dsec_one_frame_per_chunk"]
    for k in ("restic", "casync"):
        if k in sizes:
            ratios[f"dsec_vs_{k}"] = sizes["dsec"] / sizes[k]
    for k, r in ratios.items():
        print(f"  {k}: {r:.3f}")
    out = save("library", {
        "environments": [f"{n}@{v}" for n, v, _ in envs], "tree_bytes": tree_bytes,
        "bytes": {"tar_zstd_per_layer": tar_zst, "tar_zstd_total": tar_total, **sizes},
        "seconds": seconds, "cpu_seconds": cpu, "ratios": ratios,
        "dsec_runs": {k: [list(r) for r in v] for k, v in runs.items()},
    })
    print(f"results: {out}")
