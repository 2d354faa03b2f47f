"""Sandbox benchmark (on demand, as root): dsec against the raw runtimes, in one run.

    .venv/bin/python benchmarks/bench_sandbox.py [--n 40] [--idle 100]

Measures container create -> exec `true` -> destroy (p50/p99) next to `runc run` and `bwrap`
on the same prepared rootfs, container creations/s, fncall pool call latency and calls/s,
the warm exec round trip, and memory per idle container sandbox. Writes
docs/benchmarks-sandbox.md and benchmarks/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchmarks.common import busybox_node, pct  # noqa: E402
from benchmarks.common import samples as timed  # noqa: E402

IMAGE = "busybox@1.35-1"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks sandbox")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--idle", type=int, default=100)
    args = ap.parse_args(argv)
    tmp = busybox_node("dsec-bench-")
    from dsec_cli.run.node import CreateOptions, Node

    node = Node()
    node.create(IMAGE, CreateOptions())  # materialize the layer once
    node.gc(budget=1 << 40)
    for r in node.db.all():
        node.remove(r.id)
    res: dict[str, object] = {"n": args.n, "cpus": os.cpu_count()}

    # raw runtimes on the same tree (the materialized layer dir plus mount points)
    rootfs = tmp / "raw-rootfs"
    rootfs.mkdir()
    subprocess.run(["tar", "-xf", str(REPO / "layerspecs/busybox/busybox-rootfs.tar"), "-C",
                    str(rootfs)], check=True)
    bundle = tmp / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "-b", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": True}
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/bin/true"]
    (bundle / "config.json").write_text(json.dumps(spec))
    runc_root = tmp / "runc-raw"
    i = [0]

    def raw_runc() -> None:
        i[0] += 1
        subprocess.run(["runc", "--root", str(runc_root), "run", "-b", str(bundle),
                        f"raw{i[0]}"], check=True, stdin=subprocess.DEVNULL)

    def raw_bwrap() -> None:
        subprocess.run(["bwrap", "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
                        "--unshare-all", "--", "/bin/true"], check=True)

    def dsec_container() -> None:
        rec = node.create(IMAGE, CreateOptions())
        node.exec(rec.id, ["true"])
        node.remove(rec.id)

    def dsec_fncall_backend() -> None:
        rec = node.create(IMAGE, CreateOptions(backend="fncall"))
        node.exec(rec.id, ["true"])
        node.remove(rec.id)

    for name, fn in [("raw_runc_run", raw_runc), ("raw_bwrap", raw_bwrap),
                     ("container_create_exec_destroy", dsec_container),
                     ("fncall_backend_create_exec_destroy", dsec_fncall_backend)]:
        fn()  # warm up
        xs = timed(fn, args.n)
        res[name] = {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3}
    res["container_vs_runc_p50"] = (res["container_create_exec_destroy"]["p50_ms"]  # type: ignore[index]
                                    / res["raw_runc_run"]["p50_ms"])  # type: ignore[index]

    # creations per second: parallel creates (each waits until its agent answers)
    ids: list[str] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        ids = [r.id for r in ex.map(lambda _: node.create(IMAGE, CreateOptions()),
                                    range(args.n * 2))]
    res["container_creations_per_s"] = len(ids) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(node.remove, ids))
    res["container_removals_per_s"] = len(ids) / (time.perf_counter() - t0)

    # warm exec round trip
    rec = node.create(IMAGE, CreateOptions())
    node.exec(rec.id, ["true"])
    xs = timed(lambda: node.exec(rec.id, ["true"]), 300)
    res["warm_exec"] = {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3}
    node.remove(rec.id)

    # fncall pool
    import sandbox_fnfuncs

    from dsec_cli.backends.fnpool import FunctionPool

    with FunctionPool(2) as pool:
        pool.call(sandbox_fnfuncs.add, 1, 2)
        xs = timed(lambda: pool.call(sandbox_fnfuncs.add, 1, 2), 300)
        res["fncall_call"] = {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3,
                              "sequential_calls_per_s": len(xs) / sum(xs)}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda k: pool.call(sandbox_fnfuncs.add, k, 1), range(600)))
        res["fncall_calls_per_s"] = 600 / (time.perf_counter() - t0)
        xs = timed(lambda: pool.run(["true"]), 100)
        res["fncall_command"] = {"p50_ms": pct(xs, 50) * 1e3}

    # memory per idle sandbox
    before = mem_available()
    idle = [node.create(IMAGE, CreateOptions()).id for _ in range(args.idle)]
    time.sleep(1)
    after = mem_available()
    rss = []
    cg = []
    for sid in idle:
        d = node.describe(sid)
        cg.append(d.get("memory", 0))
        status = Path(f"/proc/{d['pid']}/status").read_text()
        rss.append(int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]))
    res["idle"] = {"count": args.idle,
                   "host_memory_per_sandbox_mib": (before - after) / args.idle / 2**20,
                   "agent_rss_kib_p50": statistics.median(rss),
                   "cgroup_memory_per_sandbox_mib": statistics.mean(cg) / 2**20}
    # MemAvailable is noisy on a shared machine: never estimate below what the cgroups charge
    per = max((before - after) / args.idle, statistics.mean(cg), 1)
    res["idle"]["fit_in_24GiB"] = int(24 * 2**30 / per)  # type: ignore[index]
    for sid in idle:
        node.remove(sid)
    node.gc(budget=0)

    out = REPO / "benchmarks/results/sandbox.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    write_doc(res)
    print(json.dumps(res, indent=2))
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


def write_doc(r: dict) -> None:  # type: ignore[type-arg]
    c, rr, rb = r["container_create_exec_destroy"], r["raw_runc_run"], r["raw_bwrap"]
    fb = r["fncall_backend_create_exec_destroy"]
    doc = f"""# Sandbox benchmarks

Measured by `benchmarks/bench_sandbox.py` (n={r['n']}, {r['cpus']} CPUs, runc 1.1.5,
bubblewrap 0.8, busybox image, as root), everything in one run. Regenerate with
`.venv/bin/python benchmarks/bench_sandbox.py`.

| measure | dsec | peer (same run) | target |
| --- | --- | --- | --- |
| container create -> exec `true` -> destroy, p50 | {c['p50_ms']:.1f} ms | `runc run` of `true`: {rr['p50_ms']:.1f} ms | <= 1.5x runc: **{r['container_vs_runc_p50']:.2f}x** |
| same, p99 | {c['p99_ms']:.1f} ms | {rr['p99_ms']:.1f} ms | |
| fncall backend create -> exec -> destroy, p50 | {fb['p50_ms']:.1f} ms | `bwrap ... true`: {rb['p50_ms']:.1f} ms | |
| container creations/s (8 threads) | {r['container_creations_per_s']:.1f}/s | | >= 30/s |
| container removals/s (8 threads) | {r['container_removals_per_s']:.1f}/s | | |
| warm exec round trip p50 / p99 | {r['warm_exec']['p50_ms']:.2f} / {r['warm_exec']['p99_ms']:.2f} ms | | <= 5 ms |
| fncall pool call p50 (Python callable) | {r['fncall_call']['p50_ms']:.2f} ms | | |
| fncall pool calls/s (2 workers, 2 threads) | {r['fncall_calls_per_s']:.0f}/s | | >= 100/s |
| fncall pool command (`true`) p50 | {r['fncall_command']['p50_ms']:.2f} ms | | |
| host memory per idle container ({r['idle']['count']} idle) | {r['idle']['host_memory_per_sandbox_mib']:.2f} MiB | | <= 2 MiB |
| agent RSS per idle container | {r['idle']['agent_rss_kib_p50']:.0f} KiB | | |
| cgroup-charged memory per idle container | {r['idle']['cgroup_memory_per_sandbox_mib']:.2f} MiB | | |
| idle containers that fit in 24 GiB (max of the two above) | {r['idle']['fit_in_24GiB']} | | >= 2,400 |

Notes: "host memory" is the drop of MemAvailable while the idle sandboxes exist (agent,
overlay and namespace kernel objects, page cache of per-sandbox files); on a shared machine
it is noisy, so the fit estimate uses the larger of it and the cgroup-charged memory. The raw
`runc run` column runs the container in the foreground and has no overlay mount, agent,
store pin or database row. The machine is shared with other test suites: figures move with
its load (rerun on a quiet node for release numbers).

Where targets are missed: container create -> exec -> destroy is close to 1.5x a foreground
`runc run` (the detached start, the agent handshake, the overlay mount, the store pin and
three sqlite transactions), and creations/s is bounded by runc's own start (its three
processes and the copy of its binary into a sealed memfd it makes on every start) on 2 CPUs.
Known levers not taken yet: a pool of pre-created containers per image (the fncall pool's
trick), `runc create` ahead of demand, starting runc from an already-sealed copy of its
binary, and releasing the store pin asynchronously.
"""
    (REPO / "docs/benchmarks-sandbox.md").write_text(doc)


if __name__ == "__main__":
    main()
