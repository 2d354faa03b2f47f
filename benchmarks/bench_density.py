"""Density benchmark (on demand, as root): latency-class exec under a saturating batch load,
and memory given back by idle sandboxes.

    python -m benchmarks density [--n 300] [--batch 4] [--idle 8] [--hold 64]

1. A ``latency``-class container and a default (``batch``) container, both idle: the warm
   exec round trip of ``true`` (p50/p99), unloaded.
2. ``--batch`` batch-class containers each spinning a shell loop (at least one per core:
   both cores saturated), and ``--idle`` idle containers each holding ``--hold`` MiB of
   private memory: the same round trips again, for the latency-class sandbox and, as the
   peer in the same run, the default-class one.
3. The idle sandboxes reclaimed (node gc's idle policy, to a swap file made for the run when
   the host has no swap): resident bytes before and after.
4. With ``--vms N``: N idle 512 MiB microvms, their QEMUs' resident memory with KSM off, then
   with KSM on (scanning fast) once merging settles; the host's KSM settings are restored.

Writes benchmarks/results/density[-LABEL].json and prints the figures; docs/benchmarks.md
quotes them with the load they were measured under.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import save

REPO = Path(__file__).resolve().parents[1]
IMAGE = "busybox@1.35-1"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def round_trips(node: Any, sid: str, n: int) -> dict[str, float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        node.exec(sid, ["true"])
        out.append(time.perf_counter() - t0)
    return {"p50_ms": round(statistics.median(out) * 1e3, 2),
            "p99_ms": round(pct(out, 99) * 1e3, 2), "n": n}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks density")
    ap.add_argument("--n", type=int, default=300, help="exec round trips per measurement")
    ap.add_argument("--batch", type=int, default=max(2, 2 * (os.cpu_count() or 1)))
    ap.add_argument("--idle", type=int, default=8)
    ap.add_argument("--hold", type=int, default=64, help="MiB each idle sandbox touches")
    ap.add_argument("--vms", type=int, default=0, help="idle microvms for the KSM phase")
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-density-", dir="/var/tmp"))
    os.environ.update({"DSEC_STATE_DIR": str(tmp / "node"), "DSEC_STORE": (tmp / "store").as_uri(),
                       "XDG_DATA_HOME": str(tmp / "data"), "XDG_CONFIG_HOME": str(tmp / "cfg")})
    swap = None
    try:
        from dsec_cli.run import density

        if not density.host_facts()["swap_total"]:
            swap = tmp / "bench.swap"
            density.add_swap(swap, (args.idle * args.hold + 256) << 20)
        res = run(args, tmp)
        res["swap_made_for_run"] = swap is not None
        name = "density" + (f"-{args.label}" if args.label else "")
        print(save(name, res))
    finally:
        from dsec_cli.run.node import Node

        node = Node()
        for r in node.db.all():
            node.remove(r.id)
        if swap is not None:
            density.remove_swap(swap)
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    from dsec_cli.build.builder import build
    from dsec_cli.run.node import CreateOptions, Node

    build([REPO / "layerspecs/busybox/busybox.yaml"], os.environ["DSEC_STORE"])
    node = Node()
    lat = node.create(IMAGE, CreateOptions(cpu_class="latency")).id
    plain = node.create(IMAGE, CreateOptions()).id
    for sid in (lat, plain):
        round_trips(node, sid, 20)  # warm the agent connections
    res: dict[str, Any] = {"cpus": os.cpu_count(), "batch_sandboxes": args.batch,
                           "idle_sandboxes": args.idle, "idle_hold_mib": args.hold,
                           "unloaded": {"latency": round_trips(node, lat, args.n),
                                        "default": round_trips(node, plain, args.n)}}
    idle = []
    for _ in range(args.idle):
        sid = node.create(IMAGE, CreateOptions(cpu_class="idle", memory=1 << 30)).id
        node.exec(sid, ["sh", "-c", f"(dd if=/dev/urandom bs={args.hold}M count=1 "
                                    "iflag=fullblock | sleep 100000) >/dev/null 2>&1 &"])
        idle.append(sid)
    deadline = time.monotonic() + 120
    while min(d.get("anon", 0) for d in node.top() if d["id"] in idle) < (args.hold - 4) << 20:
        if time.monotonic() > deadline:
            raise SystemExit("the idle sandboxes did not fill their memory within 120 s")
        time.sleep(0.2)
    for _ in range(args.batch):
        sid = node.create(IMAGE, CreateOptions(cpu_class="batch")).id
        node.exec(sid, ["sh", "-c", "(while :; do :; done) >/dev/null 2>&1 &"])
    time.sleep(2)  # the load settles
    load = os.getloadavg()[0]
    res["loaded"] = {"latency": round_trips(node, lat, args.n),
                     "default": round_trips(node, plain, args.n),
                     "loadavg_1m": round(load, 2)}
    before = {d["id"]: d.get("resident", 0) for d in node.top() if d["id"] in idle}
    for sid in idle:  # idle for an hour, as far as the idle policy can tell
        old = time.time() - 3600
        os.utime(node.sandboxes_dir / sid / "active", (old, old))
    os.environ["DSEC_IDLE_RECLAIM"] = "10m"
    t0 = time.perf_counter()
    node.gc(budget=1 << 40)
    reclaim_s = time.perf_counter() - t0
    after = {d["id"]: d for d in node.top() if d["id"] in idle}
    res["idle_memory"] = {
        "resident_before_mib": round(sum(before.values()) / len(idle) / 2**20, 1),
        "resident_after_mib": round(sum(d.get("resident", 0) for d in after.values())
                                    / len(idle) / 2**20, 1),
        "swapped_mib": round(sum(d.get("swapped", 0) for d in after.values())
                             / len(idle) / 2**20, 1),
        "reclaim_seconds_total": round(reclaim_s, 2)}
    for r in node.db.all():  # the load ends before the VM phase
        node.remove(r.id)
    if args.vms:
        res["ksm"] = ksm_phase(node, args.vms)
    for k in ("unloaded", "loaded", "idle_memory", "ksm"):
        print(k, res.get(k))
    return res


def ksm_phase(node: Any, n: int) -> dict[str, Any]:
    from dsec_cli.run import density
    from dsec_cli.run.node import CreateOptions

    names = ("run", "pages_to_scan", "sleep_millisecs")
    saved = {k: (density.KSM / k).read_text().strip() for k in names}
    try:
        (density.KSM / "run").write_text("2")  # off, nothing merged
        vms = [node.create(IMAGE, CreateOptions(backend="microvm", memory=512 << 20)).id
               for _ in range(n)]
        time.sleep(10)  # boot settles, freed pages reported back

        def resident() -> int:
            return sum(d.get("resident", 0) for d in node.top() if d["id"] in vms)

        off = resident()
        density.setup(ksm=True, ksm_pages=4000)
        (density.KSM / "sleep_millisecs").write_text("10")
        last, stable = -1, 0
        deadline = time.monotonic() + 120
        while stable < 3 and time.monotonic() < deadline:  # merging settles
            time.sleep(2)
            now = density.ksm_state()["pages_sharing"]
            stable = stable + 1 if now == last else 0
            last = now
        on = resident()
        return {"vms": n, "memory_mib": 512, "resident_ksm_off_mib": round(off / n / 2**20, 1),
                "resident_ksm_on_mib": round(on / n / 2**20, 1),
                "saved_fraction": round(1 - on / off, 3) if off else None,
                "ksm_saved_mib_total": round(density.ksm_state()["saved_bytes"] / 2**20, 1)}
    finally:
        for r in node.db.all():
            node.remove(r.id)
        if saved["run"] != "1":
            (density.KSM / "run").write_text("2")
        for k, v in saved.items():
            (density.KSM / k).write_text(v)
