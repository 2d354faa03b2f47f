"""Pre-warm: the first use of a parked sandbox's memory after a plain thaw against after a
thaw with prefetch (`dsec thaw --prefetch`, `job.prewarm()`).

Each run: a container declaring 1 GiB holds ``--hold`` MiB of random bytes in `dd`'s buffer,
written into a pipe whose reader waits on a FIFO. Touching it (the "turn") opens the FIFO: the
reader drains the pipe, so dd reads every page of its buffer once, and the turn ends when dd
exits. Three cases, interleaved per run: the turn on a sandbox never parked (the floor); parked
then plain `thaw` then the turn (its pages fault in from swap one by one); parked then
`thaw --prefetch` (timed: the pre-warm) then the turn. A swap file is made for the run when
the host has none, and removed after.

    python -m benchmarks prewarm [--hold 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from .common import busybox_node, node_run, save

IMAGE = "busybox@1.35-1"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks prewarm")
    ap.add_argument("--hold", type=int, default=512, help="MiB held in the sandbox")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = busybox_node("dsec-bench-prewarm-", config=True)
    from dsec_cli.run.node import Node

    with node_run(tmp, swap=(args.hold + 512) << 20) as swap:
        res = run(Node(), args)
        res["swap_made_for_run"] = swap is not None
        print(save("prewarm", res))


def _holder(node: Any, hold: int) -> Any:
    from dsec_cli.backends import _cgroups
    from dsec_cli.run.node import CreateOptions

    rec = node.create(IMAGE, CreateOptions(backend="container", memory=1 << 30))
    node.exec(rec.id, ["sh", "-c", "mkfifo /tmp/go && (dd if=/dev/urandom bs=" + str(hold)
                       + "M count=1 iflag=fullblock 2>/dev/null | (read x < /tmp/go; "
                       "cat > /dev/null)) >/dev/null 2>&1 &"])
    cg = _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}")
    deadline = time.monotonic() + 120
    while cg.memory_use().get("anon", 0) < (hold - 8) << 20:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{hold} MiB never became resident")
        time.sleep(0.2)
    return rec


def _turn(node: Any, sid: str) -> float:
    """Open the FIFO and wait for dd to have read its whole buffer out."""
    t0 = time.monotonic()
    node.exec(sid, ["sh", "-c", "echo > /tmp/go; while pidof dd >/dev/null; do usleep 2000; "
                                "done"])
    return time.monotonic() - t0


def run(node: Any, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for _ in range(args.runs):
        row: dict[str, Any] = {}
        for case in ("never_parked", "thaw", "thaw_prefetch"):
            rec = _holder(node, args.hold)
            try:
                if case != "never_parked":
                    node.park(rec.id)
                    t0 = time.monotonic()
                    out = node.thaw(rec.id, prefetch=case == "thaw_prefetch")
                    row[f"{case}_thaw_s"] = time.monotonic() - t0
                    row[f"{case}_resident_after_thaw"] = out.get("resident")
                row[f"{case}_turn_s"] = _turn(node, rec.id)
            finally:
                node.remove(rec.id)
        rows.append(row)
        print(f"turn: never parked {row['never_parked_turn_s'] * 1000:.0f} ms; plain thaw "
              f"{row['thaw_thaw_s'] * 1000:.0f} ms + turn {row['thaw_turn_s'] * 1000:.0f} ms; "
              f"prefetch thaw {row['thaw_prefetch_thaw_s'] * 1000:.0f} ms + turn "
              f"{row['thaw_prefetch_turn_s'] * 1000:.0f} ms", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
           if k.endswith("_s")}
    return {"hold_mib": args.hold, "runs": rows, "median": med,
            "turn_after_prefetch_over_never_parked":
                med["thaw_prefetch_turn_s"] / med["never_parked_turn_s"],
            "turn_after_plain_thaw_over_never_parked":
                med["thaw_turn_s"] / med["never_parked_turn_s"]}
