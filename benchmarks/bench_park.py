"""Park and thaw of a container sandbox holding MiB of private memory.

Each run: a container declaring 1 GiB starts a process holding ``--hold`` MiB of random
bytes (anonymous memory), then `park` (freeze, push the memory out to swap) and `thaw` are
timed, and the first exec after thaw. A swap file is made for the run unless the host has
enough swap free, and removed after. Figures: park and thaw latency (median), memory given
back.

    python -m benchmarks park [--hold 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from .common import busybox_node, node_run, save


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks park")
    ap.add_argument("--hold", type=int, default=512, help="MiB held in the sandbox")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = busybox_node("dsec-bench-park-", config=True)
    from dsec_cli.run.node import Node

    with node_run(tmp, swap=(args.hold + 512) << 20) as swap:
        res = run(Node(), args)
        res["swap_made_for_run"] = swap is not None
        print(save("park", res))


def run(node: Any, args: argparse.Namespace) -> dict[str, Any]:
    from dsec_cli.backends import _cgroups
    from dsec_cli.run.node import CreateOptions

    image = "busybox@1.35-1"
    rows = []
    for _ in range(args.runs):
        rec = node.create(image, CreateOptions(backend="container", memory=1 << 30))
        try:
            node.exec(rec.id, ["sh", "-c", f"(dd if=/dev/urandom bs={args.hold}M count=1 "
                                           "iflag=fullblock | sleep 100000) >/dev/null 2>&1 &"])
            cg = _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}")
            deadline = time.monotonic() + 120
            while cg.memory_use().get("anon", 0) < (args.hold - 8) << 20:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{args.hold} MiB never became resident")
                time.sleep(0.2)
            t0 = time.monotonic()
            parked = node.park(rec.id)
            t1 = time.monotonic()
            node.thaw(rec.id)
            t2 = time.monotonic()
            node.exec(rec.id, ["true"])
            t3 = time.monotonic()
            rows.append({"park_s": t1 - t0, "thaw_s": t2 - t1, "first_exec_s": t3 - t2,
                         "resident": parked.get("resident"), "reclaimed": parked.get("reclaimed"),
                         "swapped": parked.get("swapped")})
        finally:
            node.remove(rec.id)
    for r in rows:
        print(f"park {r['park_s'] * 1000:.0f} ms, thaw {r['thaw_s'] * 1000:.0f} ms, first exec "
              f"{r['first_exec_s'] * 1000:.0f} ms; resident after park "
              f"{(r['resident'] or 0) >> 20} MiB, reclaimed {(r['reclaimed'] or 0) >> 20} MiB")
    return {"hold_mib": args.hold, "runs": rows,
            "park_median_s": statistics.median(r["park_s"] for r in rows),
            "thaw_median_s": statistics.median(r["thaw_s"] for r in rows),
            "first_exec_median_s": statistics.median(r["first_exec_s"] for r in rows)}
