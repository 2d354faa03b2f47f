"""Park and thaw of a container sandbox holding MiB of private memory, and of a microvm.

Each run: a container declaring 1 GiB starts a process holding ``--hold`` MiB of random
bytes (anonymous memory), then `park` (freeze, push the memory out to swap) and `thaw` are
timed, and the first exec after thaw. A swap file is made for the run unless the host has
enough swap free, and removed after. Figures: park and thaw latency (median), memory given
back.

Then (unless ``--vm-runs 0``) a microvm of ``--vm-memory`` MiB whose guest holds
``--vm-hold`` MiB of random bytes (in its /dev/shm): park (QEMU migration to a state file, QEMU ended) and thaw
(QEMU started from the file, to the first exec) are timed; QEMU's resident memory before
park, after park (its process is gone) and after thaw, and the state file's size.

    python -m benchmarks park [--hold 512] [--runs 3] [--vm-memory 512] [--vm-hold 200]
                              [--vm-runs 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from .common import busybox_node, node_run, save


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks park")
    ap.add_argument("--hold", type=int, default=512, help="MiB held in the sandbox")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vm-memory", type=int, default=512, help="MiB of the microvm")
    ap.add_argument("--vm-hold", type=int, default=200,
                    help="MiB of random bytes the guest keeps in its /dev/shm")
    ap.add_argument("--vm-runs", type=int, default=1, help="VM park/thaw cycles (0: none)")
    args = ap.parse_args(argv)
    tmp = busybox_node("dsec-bench-park-", config=True)
    from dsec_cli.run.node import Node

    with node_run(tmp, swap=(args.hold + 512) << 20) as swap:
        res = run(Node(), args)
        res["swap_made_for_run"] = swap is not None
        if args.vm_runs:
            res["microvm"] = run_vm(Node(), args)
            compare(res)
        res["loadavg"] = list(os.getloadavg())
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


def run_vm(node: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One microvm booted once, parked and thawed ``--vm-runs`` times."""
    from dsec_cli.backends import _cgroups
    from dsec_cli.backends.vm import vmpark
    from dsec_cli.run.node import CreateOptions

    rec = node.create("busybox@1.35-1", CreateOptions(backend="microvm",
                                                      memory=args.vm_memory << 20))
    rows = []
    try:
        # random bytes in the guest's tmpfs: guest RAM that is neither zero nor free
        r = node.exec(rec.id, ["sh", "-c", "dd if=/dev/urandom of=/dev/shm/hold bs=1M "
                                           f"count={args.vm_hold}"], timeout=300)
        assert r.exit_code == 0, r.stderr
        pid = int(node.lookup(rec.id).handle["pid"])
        deadline = time.monotonic() + 300
        while vmpark.rss(pid) < (args.vm_hold << 20):  # the guest's bytes are in QEMU's RAM
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args.vm_hold} MiB never became resident in QEMU")
            time.sleep(0.5)
        time.sleep(2)
        mi = node.exec(rec.id, ["sh", "-c", "grep -E '^(Shmem|MemFree):' /proc/meminfo"])
        guest = {ln.split(":")[0]: int(ln.split()[1]) << 10
                 for ln in mi.stdout.decode().splitlines()}
        cg = _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}")
        for _ in range(args.vm_runs):
            pid = int(node.lookup(rec.id).handle["pid"])
            rss_before = vmpark.rss(pid)
            t0 = time.monotonic()
            parked = node.park(rec.id)
            t1 = time.monotonic()
            rss_parked = vmpark.rss(pid)  # 0: the process is gone
            group_parked = cg.memory_use().get("resident", 0)
            t2 = time.monotonic()
            node.thaw(rec.id)
            r = node.exec(rec.id, ["true"])
            t3 = time.monotonic()
            assert r.exit_code == 0
            rss_thawed = vmpark.rss(int(node.lookup(rec.id).handle["pid"]))
            rows.append({"park_s": t1 - t0, "thaw_to_first_exec_s": t3 - t2,
                         "qemu_rss_before": rss_before, "qemu_rss_parked": rss_parked,
                         "group_resident_parked": group_parked, "qemu_rss_thawed": rss_thawed,
                         "state_file_bytes": parked["state_bytes"],
                         "guest_shmem_before": guest.get("Shmem"),
                         "guest_free_before": guest.get("MemFree")})
    finally:
        node.remove(rec.id)
    for r in rows:
        print(f"microvm {args.vm_memory} MiB: park {r['park_s'] * 1000:.0f} ms, thaw to first "
              f"exec {r['thaw_to_first_exec_s'] * 1000:.0f} ms; QEMU RSS "
              f"{r['qemu_rss_before'] >> 20} MiB before, {r['qemu_rss_parked'] >> 20} MiB "
              f"parked, {r['qemu_rss_thawed'] >> 20} MiB after thaw; state file "
              f"{r['state_file_bytes'] >> 20} MiB; guest tmpfs "
              f"{(r['guest_shmem_before'] or 0) >> 20} MiB, free {(r['guest_free_before'] or 0) >> 20}"
              " MiB before park")
    return {"memory_mib": args.vm_memory, "hold_mib": args.vm_hold, "runs": rows,
            "park_median_s": statistics.median(r["park_s"] for r in rows),
            "thaw_to_first_exec_median_s":
                statistics.median(r["thaw_to_first_exec_s"] for r in rows)}


def compare(res: dict[str, Any]) -> None:
    vm = res["microvm"]
    v = vm["runs"][-1]
    print(f"{'':28s}{'park':>10s}{'thaw+exec':>12s}{'freed MiB':>11s}")
    c = res["runs"][-1]
    print(f"{'container ' + str(res['hold_mib']) + ' MiB held':28s}"
          f"{res['park_median_s'] * 1000:8.0f}ms"
          f"{(res['thaw_median_s'] + res['first_exec_median_s']) * 1000:10.0f}ms"
          f"{(c['reclaimed'] or 0) >> 20:11d}")
    print(f"{'microvm ' + str(vm['memory_mib']) + ' MiB, ' + str(vm['hold_mib']) + ' held':28s}"
          f"{vm['park_median_s'] * 1000:8.0f}ms{vm['thaw_to_first_exec_median_s'] * 1000:10.0f}ms"
          f"{(v['qemu_rss_before'] - v['qemu_rss_parked']) >> 20:11d}")
