"""A rollout group over a cluster: `job.group(64, ...)` across three sshd nodes on loopback.

    python -m benchmarks group [--n 64] [--backend container] [--runs 2]

Three nodes (tests/cluster/sshnodes.py, one sshd each, one store), a job started from this
process (`Job`, dsec_cli/api/jobs.py), and ``--n`` container sandboxes of the busybox example
created as one group placed over the three nodes. Each member's time is from the group call
until its sandbox was created on its node (`Member.seconds`). The peer, in the same run: the
same group on this node alone (no SSH, no placement). After each group the job is removed and
every node is checked to hold no sandbox of it.

Results: benchmarks/results/group.json (quoted in docs/benchmarks-jobs.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .common import REPO, pct, save

sys.path.insert(0, str(REPO))


def _group(n: int, image: str, backend: str, where: str | None, name: str) -> dict[str, Any]:
    from dsec_cli.api.jobs import Job

    kwargs: dict[str, Any] = {} if where is None else {"node": where}
    with Job.start(name, ttl=600, max_concurrent=n) as job:  # leaving it removes the job
        t0 = time.perf_counter()
        g = job.group(n, image, backend, **kwargs)
        g.wait(timeout=600)
        wall = time.perf_counter() - t0
        secs = [m.seconds for m in g.members if m.ok and m.seconds is not None]
        nodes = Counter(m.rollout.node if m.rollout else "-" for m in g.members)
        failed = [m.error for m in g.failed()]
        ok = g.ok()
        answered = sum(1 for m in ok if m.rollout and m.rollout.exec(["true"]).exit_code == 0)
    return {"n": n, "wall_s": wall, "per_s": n / wall,
            "member_p50_ms": statistics.median(secs) * 1e3 if secs else None,
            "member_p99_ms": pct(secs, 99) * 1e3 if secs else None,
            "members_ok": len(ok), "answered_exec": answered,
            "infra_failures": len(failed), "errors": sorted(set(failed))[:3],
            "per_node": dict(nodes)}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks group")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--backend", default="container")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("needs root (sandboxes and sshd)")
    from tests.cluster.conftest import IMAGE, _build_store
    from tests.cluster.sshnodes import destroy_cluster, make_cluster

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-group-"))
    data = root / "data"
    data.mkdir()
    url = _build_store(root, data)
    c = make_cluster(root / "nodes", url, data, 3)
    os.environ.update({**c.client_env(), "XDG_CONFIG_HOME": str(root / "home/config"),
                       "XDG_DATA_HOME": str(root / "home/data"), "DSEC_STORE": url,
                       "DSEC_STATE_DIR": str(root / "local-state")})
    from dsec_cli.core.config import save_user_config
    from dsec_cli.run.node import Node

    save_user_config({"nodes": c.config_nodes()})
    for node in c.nodes:
        node.set_capacity(sandboxes=a.n)  # room for the whole group on any one of them
    out: dict[str, Any] = {"nodes": 3, "backend": a.backend, "runs": [],
                           "load_avg_start": list(os.getloadavg())}
    local = Node(root / "local-state", url)
    try:
        _group(2, IMAGE, a.backend, None, "warm-local")  # image cached, runtimes warm
        _group(3, IMAGE, a.backend, "auto", "warm-cluster")
        for run in range(a.runs):
            for where in ("auto", None):  # interleaved: both see the same machine
                r = _group(a.n, IMAGE, a.backend, where, f"g{run}-{where or 'local'}")
                r["where"] = "3 nodes" if where else "local"
                held = [Node(n.state_dir, url) for n in c.nodes] if where else [local]
                r["left_after_rm"] = sum(len(h.db.all()) for h in held)
                out["runs"].append(r)
                print(f"{r['where']}: {a.n} members in {r['wall_s']:.1f} s, member p50 "
                      f"{r['member_p50_ms']:.0f} ms p99 {r['member_p99_ms']:.0f} ms, "
                      f"{r['infra_failures']} infra failures, {r['per_node']}, "
                      f"{r['left_after_rm']} left", flush=True)
    finally:
        for rec in local.db.all():
            local.remove(rec.id)
        destroy_cluster(c)
    out["load_avg_end"] = list(os.getloadavg())
    print(save("group", out))
