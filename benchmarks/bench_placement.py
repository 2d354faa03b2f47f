"""Placement at production scale (simulated) and the SSH round trip on real nodes.

    python -m benchmarks placement [--nodes 160] [--sandboxes 380000] [--images 5000]
                                   [--skip-real] [--runs 15]

1. Simulated: ``--nodes`` nodes of 2,400 sandbox slots each (the 24 GiB node target) plus a
   mix of larger and smaller ones, images drawn from a Zipf-like popularity over ``--images``
   images, every node starting with 100 random images cached. ``--sandboxes`` sandboxes are
   placed one by one with the linear scan (`Placer`) and with `FastPlacer`, which must make
   the same decisions; the cost per decision is the figure, against the anchor of one
   production unit (about 160 nodes) sustaining 5,000 creations per second.
2. Real: three sshd nodes on loopback (tests/cluster/sshnodes.py), fncall and container
   sandboxes: create+exec+rm through the SDK over SSH vs the same on the local node, warm exec
   round trips, the CLI's one-shot `dsec run` both ways, a node-info fan-out, and
   `create_many(60)` over the three nodes.

Results: benchmarks/results/cluster.json (quoted in docs/benchmarks-cluster.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .common import REPO, save

sys.path.insert(0, str(REPO))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(xs) * 1e3, "p99_ms": _pct(xs, 0.99) * 1e3, "n": len(xs)}


# -- 1. simulated ---------------------------------------------------------------------------------
def _views(nodes: int, images: int, seed: int) -> list[Any]:
    from dsec_cli.run.cluster.placement import NodeView

    r = random.Random(seed)
    out = []
    for i in range(nodes):
        slots = r.choice([2400, 2400, 2400, 1200, 4800])
        v = NodeView(f"n{i:03}", slots, 64.0, 256 << 30)
        for j in r.sample(range(images), 100):
            v.images[f"img{j}"] = (1 << 30, 1 << 30)
        out.append(v)
    return out


def _stream(n: int, images: int, seed: int) -> list[str]:
    r = random.Random(seed)
    weights = [1.0 / (k + 1) ** 0.8 for k in range(images)]  # a few hot task images, long tail
    return [f"img{k}" for k in r.choices(range(images), weights=weights, k=n)]


def simulate(nodes: int, sandboxes: int, images: int) -> dict[str, Any]:
    from dsec_cli.run.cluster.placement import FastPlacer, Placer

    stream = _stream(sandboxes, images, 2)
    out: dict[str, Any] = {"nodes": nodes, "sandboxes": sandboxes, "images": images}
    decisions: dict[str, list[str | None]] = {}
    for cls in (FastPlacer, Placer):
        views = _views(nodes, images, 1)
        capacity = sum(v.cap_sandboxes for v in views)
        placer = cls(views)
        cached_hits = 0
        chosen: list[str | None] = []
        t0 = time.perf_counter()
        for image in stream:
            name = placer.place(image)
            chosen.append(name)
        dt = time.perf_counter() - t0
        # cache hits: replay on fresh views (kept out of the timed loop)
        replay = {v.name: v for v in _views(nodes, images, 1)}
        for image, name in zip(stream, chosen, strict=True):
            if name is not None:
                v = replay[name]
                if v.images.get(image, (0, 0))[1]:
                    cached_hits += 1
                v.images[image] = (1 << 30, 1 << 30)
        fills = [v.used_sandboxes / v.cap_sandboxes for v in placer.views.values()]
        placed = sum(1 for c in chosen if c is not None)
        out[cls.__name__] = {
            "seconds": dt, "us_per_sandbox": dt / sandboxes * 1e6,
            "placements_per_s": sandboxes / dt, "x_anchor_5000_per_s": sandboxes / dt / 5000,
            "placed": placed, "capacity": capacity,
            "fill_min": min(fills), "fill_max": max(fills),
            "placed_on_caching_node": cached_hits / max(1, placed),
            "images_per_node_p50": statistics.median(len(v.images)
                                                     for v in placer.views.values()),
        }
        decisions[cls.__name__] = chosen
        print(f"{cls.__name__}: {dt / sandboxes * 1e6:.1f} us/sandbox, "
              f"{sandboxes / dt:,.0f}/s, fill {min(fills):.3f}-{max(fills):.3f}, "
              f"on caching node {cached_hits / max(1, placed):.1%}", flush=True)
    out["same_decisions"] = decisions["FastPlacer"] == decisions["Placer"]
    # with CPU and memory limits every decision is a full scan (FastPlacer falls back to it)
    views = _views(nodes, images, 1)
    p = Placer(views)
    n = min(20000, sandboxes)
    t0 = time.perf_counter()
    for image in stream[:n]:
        p.place(image, cpus=0.5, memory=256 << 20)
    out["scan_with_limits_us_per_sandbox"] = (time.perf_counter() - t0) / n * 1e6
    return out


def admission(rows: int = 2400, n: int = 200) -> dict[str, Any]:
    """The node-side cost of admitting one create on a node already holding ``rows``
    sandboxes (the 24 GiB node target): reserve + release, each a write transaction."""
    from dsec_cli.run.cluster.admission import Admission
    from dsec_cli.run.node import Node
    from dsec_cli.run.state import SandboxRecord

    with tempfile.TemporaryDirectory() as d:
        node = Node(d, Path(d, "store").as_uri())
        for i in range(rows):
            node.db.insert(SandboxRecord(f"s{i}", "fncall", "img", "d", "running", {},
                                         {"limits": {"cpus": 0.5, "memory": 64 << 20}}, 0,
                                         None), [])
        a = Admission(node)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            a.release(a.reserve(None, None))
            ts.append(time.perf_counter() - t0)
    out = {"rows": rows, **_ms(ts)}
    print(f"admission with {rows} sandboxes: p50 {out['p50_ms']:.2f} ms", flush=True)
    return out


# -- 2. real nodes --------------------------------------------------------------------------------
def real(runs: int) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"skipped": "needs root (sandboxes and sshd)"}
    from tests.cluster.conftest import IMAGE, _build_store
    from tests.cluster.sshnodes import destroy_cluster, make_cluster

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-cluster-"))
    data = root / "data"
    data.mkdir()
    home = root / "home"
    url = _build_store(root, data)
    c = make_cluster(root / "nodes", url, data, 3)
    env = {**c.client_env(), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_DATA_HOME": str(home / "data"), "DSEC_STORE": url,
           "DSEC_STATE_DIR": str(root / "local-state")}
    os.environ.update(env)
    from dsec_cli.api.sandboxes import Sandbox, create_many
    from dsec_cli.core.config import save_user_config
    from dsec_cli.run.cluster.api import node_status

    save_user_config({"nodes": c.config_nodes()})
    for n, slots in zip(c.nodes, (20, 40, 60), strict=True):  # as the tests: spread is visible
        n.set_capacity(sandboxes=slots)
    out: dict[str, Any] = {"nodes": 3, "runs": runs, "node_slots": [20, 40, 60]}
    try:
        for backend in ("fncall", "container"):
            for where in ("local", "node1"):
                node = None if where == "local" else where
                Sandbox.create(IMAGE, backend, node=node).remove()  # warm cache and channel
                rt, ex = [], []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    sb = Sandbox.create(IMAGE, backend, node=node)
                    r = sb.exec(["true"])
                    sb.remove()
                    rt.append(time.perf_counter() - t0)
                    assert r.exit_code == 0
                sb = Sandbox.create(IMAGE, backend, node=node)
                for _ in range(runs * 3):
                    t0 = time.perf_counter()
                    sb.exec(["true"])
                    ex.append(time.perf_counter() - t0)
                sb.remove()
                out[f"{backend}_{where}_create_exec_rm"] = _ms(rt)
                out[f"{backend}_{where}_warm_exec"] = _ms(ex)
                print(f"{backend} {where}: create+exec+rm p50 {statistics.median(rt) * 1e3:.0f} ms,"
                      f" warm exec p50 {statistics.median(ex) * 1e3:.1f} ms", flush=True)
            loc = out[f"{backend}_local_create_exec_rm"]["p50_ms"]
            rem = out[f"{backend}_node1_create_exec_rm"]["p50_ms"]
            out[f"{backend}_ssh_over_local_p50"] = rem / loc
        dsec = str(Path(sys.executable).with_name("dsec"))
        for where in ("local", "node1"):
            args = [dsec, "run", "-b", "fncall", IMAGE, "--", "true"]
            if where != "local":
                args[2:2] = ["--node", where]
            ts = []
            for _ in range(max(3, runs // 3)):
                t0 = time.perf_counter()
                subprocess.run(args, check=True, capture_output=True, env=os.environ)
                ts.append(time.perf_counter() - t0)
            out[f"cli_run_{where}"] = _ms(ts)
            print(f"cli dsec run {where}: p50 {statistics.median(ts) * 1e3:.0f} ms", flush=True)
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            assert all(r.ok for r in node_status())
            ts.append(time.perf_counter() - t0)
        out["fanout_info_3_nodes"] = _ms(ts)
        t0 = time.perf_counter()
        results = create_many(60, IMAGE, "fncall", parallel=6)
        dt = time.perf_counter() - t0
        out["create_many_60"] = {"seconds": dt, "per_s": 60 / dt,
                                 "per_node": dict(Counter(r.node for r in results)),
                                 "failed": sum(1 for r in results if not r.ok)}
        print(f"create_many(60): {dt:.1f}s, {60 / dt:.1f}/s, "
              f"{dict(Counter(r.node for r in results))}", flush=True)
        for r in results:
            if r.ok:
                r.sandbox.remove()
    finally:
        from dsec_cli.run.node import Node

        local = Node(root / "local-state", url)
        for rec in local.db.all():
            local.remove(rec.id)
        destroy_cluster(c)
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks placement")
    ap.add_argument("--nodes", type=int, default=160)
    ap.add_argument("--sandboxes", type=int, default=380_000)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    a = ap.parse_args(argv)
    import json

    from .common import RESULTS

    prev = RESULTS / "cluster.json"  # a partial run keeps the other part's last figures
    out = {k: v for k, v in (json.loads(prev.read_text()) if prev.is_file() else {}).items()
           if k in ("simulated", "real", "admission")}
    if not a.skip_sim:
        out["simulated"] = simulate(a.nodes, a.sandboxes, a.images)
        out["admission"] = admission()
    if not a.skip_real:
        out["real"] = real(a.runs)
    print(save("cluster", out))
