"""Density benchmark (on demand, as root): latency-class exec under a saturating batch load,
memory given back by idle sandboxes, KSM on idle VMs, and how many idle sandboxes one node
holds.

    python -m benchmarks density [--n 300] [--batch 4] [--idle 8] [--hold 64] [--vms 3]
    python -m benchmarks density --vms 3 --ksm-only
    python -m benchmarks density --held 1000 [--step 25] [--floor 2048]

1. A ``latency``-class container and a default (``batch``) container, both idle: the warm
   exec round trip of ``true`` (p50/p99), unloaded.
2. ``--batch`` batch-class containers each spinning a shell loop (at least one per core:
   both cores saturated), and ``--idle`` idle containers each holding ``--hold`` MiB of
   private memory: the same round trips again, for the latency-class sandbox and, as the
   peer in the same run, the default-class one.
3. The idle sandboxes reclaimed (node gc's idle policy, to a swap file made for the run
   unless the host has enough swap free): resident bytes before and after.
4. With ``--vms N``: N idle 512 MiB microvms with KSM off, then N new ones after
   `node setup --ksm`, merging settled (two full scans, then stable): their QEMUs' Pss and
   the host's used memory, per VM. The host's KSM settings are restored.

``--held N`` instead: N idle container sandboxes, each declaring 1 GiB (admitted under a
memory overcommit ratio written to the node's capacity.yaml) and holding ``--hold`` MiB of
random bytes, ramped in batches of ``--step``, each batch pushed to swap by the idle-reclaim
policy once idle. The ramp stops early (and says why) if MemAvailable would fall under
``--floor`` MiB. Then: how many answer an exec and still hold their bytes, host memory used
(MemTotal - MemAvailable over the start, and the sum of the sandboxes' cgroups), per
sandbox, swap used, create rate and times. A swap file is made for the run unless the host has
that much swap free (refused if the disk cannot take it); sandboxes and swap file are removed after, also
on Ctrl-C.

Writes benchmarks/results/density[-held][-LABEL].json and prints the figures;
docs/benchmarks.md quotes them with the load they were measured under.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time
from typing import Any

from .common import busybox_node, meminfo, node_run, remove_sandboxes, save

IMAGE = "busybox@1.35-1"
MiB = 1 << 20


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


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat; idle and iowait are not busy."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    total = sum(vals[:8])  # guest time is already counted in user
    return total - vals[3] - vals[4], total


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks density")
    ap.add_argument("--n", type=int, default=300, help="exec round trips per measurement")
    ap.add_argument("--batch", type=int, default=max(2, 2 * (os.cpu_count() or 1)))
    ap.add_argument("--idle", type=int, default=8)
    ap.add_argument("--hold", type=int, default=64, help="MiB each idle sandbox touches")
    ap.add_argument("--vms", type=int, default=0, help="idle microvms for the KSM phase")
    ap.add_argument("--ksm-only", action="store_true", help="only the KSM phase (--vms)")
    ap.add_argument("--held", type=int, default=0, metavar="N",
                    help="instead: hold N idle 1 GiB sandboxes with reclamation on")
    ap.add_argument("--step", type=int, default=25, help="--held: sandboxes per ramp batch")
    ap.add_argument("--floor", type=int, default=2048,
                    help="--held: MiB of MemAvailable below which the ramp stops")
    ap.add_argument("--idle-after", type=float, default=2.0,
                    help="--held: seconds without exec after which idle reclaim takes a batch")
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    if args.held:
        if args.held < 1 or args.step < 1 or args.hold < 1:
            ap.error("--held, --step and --hold must be positive")
        swap = held_swap(args.held, args.hold)
    elif args.ksm_only:
        if args.vms < 1:
            ap.error("--ksm-only needs --vms N")
        swap = 0
    else:
        swap = (args.idle * args.hold + 256) << 20
    tmp = busybox_node("dsec-bench-density-", config=True)
    with node_run(tmp, swap=swap) as made:
        if args.held:
            res = held(args)
            name = "density-held"
        elif args.ksm_only:
            from dsec_cli.run.node import Node

            res = {"ksm": ksm_phase(Node(), args.vms)}
            print("ksm", res["ksm"])
            name = "density-ksm"
        else:
            res = run(args)
            name = "density"
        res["swap_made_for_run"] = made is not None
        name += f"-{args.label}" if args.label else ""
        print(save(name, res))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsec_cli.run.node import CreateOptions, Node

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
    busy0 = cpu_times()
    res["loaded"] = {"latency": round_trips(node, lat, args.n),
                     "default": round_trips(node, plain, args.n),
                     "loadavg_1m": round(load, 2)}
    busy1 = cpu_times()
    # the share of both cores busy while the loaded round trips ran: near 1.0 when the
    # batch sandboxes saturate the machine, which is what the loaded figures claim
    res["loaded"]["cpu_busy_fraction"] = round(
        (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]), 3)
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
    """n idle 512 MiB microvms on the node as it is with KSM off, then n new ones after
    `node setup --ksm` (VMs booted while KSM runs zero what their guests free), each fleet
    measured once idle (and, with KSM, once merging settled): the QEMUs' proportional
    resident memory (Pss: a merged page counts once over its sharers) and the host's
    MemTotal - MemAvailable over what it was before the fleet. KSM's settings are restored."""
    from dsec_cli.run import density

    names = ("run", "pages_to_scan", "sleep_millisecs", "use_zero_pages")
    saved = {k: (density.KSM / k).read_text().strip() for k in names
             if (density.KSM / k).exists()}
    try:
        (density.KSM / "run").write_text("2")  # off, nothing merged
        off = _vm_fleet(node, n, merge=False)
        density.setup(ksm=True, ksm_pages=4000)
        (density.KSM / "sleep_millisecs").write_text("10")
        on = _vm_fleet(node, n, merge=True)
        return {"vms": n, "memory_mib": 512, "ksm_off": off, "ksm_on": on,
                "saved_fraction_pss": round(1 - on["pss_mib"] / off["pss_mib"], 3),
                "saved_fraction_pss_anon": round(1 - on["pss_anon_mib"] / off["pss_anon_mib"],
                                                 3),
                "saved_fraction_guest_ram": round(1 - on["guest_ram_pss_mib"]
                                                  / off["guest_ram_pss_mib"], 3),
                # None where other processes moved MemAvailable more than the VMs did
                "saved_fraction_host": round(1 - on["host_used_delta_mib"]
                                             / off["host_used_delta_mib"], 3)
                if 0 < on["host_used_delta_mib"] <= off["host_used_delta_mib"] * 2 else None}
    finally:
        for r in node.db.all():
            node.remove(r.id)
        if saved["run"] != "1":
            (density.KSM / "run").write_text("2")
        for k, v in saved.items():
            (density.KSM / k).write_text(v)


def _vm_fleet(node: Any, n: int, merge: bool) -> dict[str, Any]:
    """Boot n idle microvms, measure them (per VM, MiB), remove them."""
    from dsec_cli.run import density
    from dsec_cli.run.node import CreateOptions

    def used() -> int:
        m = meminfo()
        return m["MemTotal"] - m["MemAvailable"]

    before = used()
    t0 = time.monotonic()
    vms = [node.create(IMAGE, CreateOptions(backend="microvm", memory=512 << 20))
           for _ in range(n)]
    boot_s = time.monotonic() - t0
    overridden = 0  # KSM is host-wide: another process may switch it meanwhile

    def hold_ksm() -> None:
        nonlocal overridden
        if (density.KSM / "run").read_text().strip() != ("1" if merge else "2"):
            overridden += 1
            (density.KSM / "run").write_text("1" if merge else "2")

    for _ in range(10):  # boot settles, freed pages reported back
        time.sleep(2)
        hold_ksm()
    waited = 0.0
    if merge:  # two full scans at least (the first only finds candidates), then stable
        t1 = time.monotonic()
        scans0 = density.ksm_state()["full_scans"]
        last, stable = -1, 0
        while time.monotonic() - t1 < 300:  # stable: these VMs' Pss, not the host's counters
            time.sleep(2)
            hold_ksm()
            now = sum(_pss(r.handle["pid"])["Pss"] for r in vms)
            stable = stable + 1 if abs(now - last) < n * MiB // 2 else 0
            last = now
            if density.ksm_state()["full_scans"] >= scans0 + 2 and stable >= 3:
                break
        waited = time.monotonic() - t1
    hold_ksm()
    pss = [_pss(r.handle["pid"], ram=512 << 20) for r in vms]
    group = sum(d.get("resident", 0) for d in node.top() if d["id"] in {r.id for r in vms})
    delta = used() - before
    k = density.ksm_state()
    for r in vms:
        node.remove(r.id)
    return {**{f"{k.lower()}_mib": round(sum(p[k] for p in pss) / n / MiB, 1)
               for k in ("Pss", "Pss_Anon", "Guest_RAM_Pss")},
            "host_used_delta_mib": round(delta / n / MiB, 1),
            "cgroup_resident_mib": round(group / n / MiB, 1), "boot_s": round(boot_s, 1),
            "merge_wait_s": round(waited, 1), "loadavg_1m": round(os.getloadavg()[0], 2),
            "ksm_saved_mib_total": round(k.get("saved_bytes", 0) / MiB, 1) if merge else 0,
            "ksm_full_scans": k.get("full_scans"), "ksm_switched_by_others": overridden}


def _pss(pid: int, ram: int = 0) -> dict[str, int]:
    """A process's proportional resident bytes (a page shared by n processes, a KSM-merged
    one among them, counts 1/n), its anonymous part, and with ``ram`` the part in its
    mappings of exactly that size (a VM's guest RAM)."""
    out = {"Pss": 0, "Pss_Anon": 0, "Guest_RAM_Pss": 0}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in out:
                out[key] = int(line.split()[1]) << 10
    if ram:
        size = 0
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and ":" not in head[0]:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    size = hi - lo
                elif head and head[0] == "Pss:" and size == ram:
                    out["Guest_RAM_Pss"] += int(head[1]) << 10
    return out


# -- held: how many idle sandboxes one node keeps alive ------------------------------------------
DECLARED = 1 << 30  # what each held sandbox declares


def held_swap(n: int, hold: int) -> int:
    """Swap for n sandboxes' held memory, their agents' and shells' own pages, and 1 GiB."""
    return n * (hold + 2) * MiB + 1024 * MiB


def _mem_used() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def _swap_used() -> int:
    m = meminfo()
    return m["SwapTotal"] - m["SwapFree"]


def _raise_nofile(need: int) -> None:
    """One agent connection per sandbox stays open in this process: lift the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise SystemExit(f"open files limit {hard} is under the {need} this run needs "
                             "(one agent connection per sandbox): raise it (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def held(args: argparse.Namespace) -> dict[str, Any]:
    """Ramp up to ``args.held`` idle container sandboxes, each declaring 1 GiB and holding
    ``args.hold`` MiB of random bytes, in batches of ``args.step``: a batch is created
    (admitted by the node's capacity with a memory overcommit ratio written to its
    capacity.yaml), fills its memory, and once idle the node's idle-reclaim policy pushes it
    out to swap. The ramp stops early, saying why, if MemAvailable would go under
    ``args.floor`` MiB, swap runs short or admission refuses. Then the memory figures, and
    every sandbox is checked: it answers an exec and its holder is still there."""
    from dsec_cli.backends import _cgroups
    from dsec_cli.core.errors import DsecError
    from dsec_cli.run import density
    from dsec_cli.run.cluster.admission import Admission
    from dsec_cli.run.node import CreateOptions, Node

    n, hold, floor = args.held, args.hold, args.floor * MiB
    _raise_nofile(n + 1024)
    node = Node()
    ratio = max(1, math.ceil(n * DECLARED * 1.05 / meminfo()["MemTotal"]))
    (node.root / "capacity.yaml").write_text(f"memory_overcommit: {ratio}\n")
    adm = Admission(node)
    fill = ["sh", "-c", f"(dd if=/dev/urandom bs={hold}M count=1 iflag=fullblock | "
                        "sleep 1000000) >/dev/null 2>&1 &"]

    def cgroup(sid: str) -> _cgroups.Cgroup:
        return _cgroups.Cgroup(f"{node.cgroup_parent}/{sid}")

    def create() -> str:
        token = adm.reserve(None, DECLARED, "idle")
        try:
            return node.create(IMAGE, CreateOptions(cpu_class="idle", memory=DECLARED),
                               from_pool=False, sid=token).id
        finally:
            adm.release(token)

    base_used, base_swap = _mem_used(), _swap_used()
    base_rss = _rss_self()
    load0 = os.getloadavg()
    ids: list[str] = []
    stopped = ""
    create_s = reclaim_s = 0.0
    t_start = time.monotonic()
    while len(ids) < n and not stopped:
        step = min(args.step, n - len(ids))
        batch: list[str] = []
        for _ in range(step):
            m = meminfo()
            if m["MemAvailable"] < floor + 2 * hold * MiB:
                stopped = f"MemAvailable {m['MemAvailable'] >> 20} MiB reached the floor"
            elif m["SwapFree"] < 2 * hold * MiB:
                stopped = f"swap nearly full ({m['SwapFree'] >> 20} MiB free)"
            if stopped:
                break
            t0 = time.perf_counter()
            try:
                sid = create()
            except DsecError as e:
                stopped = f"create refused: {e}"
                break
            create_s += time.perf_counter() - t0
            node.exec(sid, fill)
            batch.append(sid)
        ids += batch
        deadline = time.monotonic() + 120 + 2 * len(batch)
        for sid in batch:  # every holder has its bytes before the batch is reclaimed
            while cgroup(sid).memory_use().get("anon", 0) < (hold - 4) * MiB:
                if time.monotonic() > deadline:
                    raise SystemExit(f"sandbox {sid} did not fill {hold} MiB in time")
                time.sleep(0.1)
        time.sleep(args.idle_after)  # the batch has been idle that long: the policy takes it
        t0 = time.perf_counter()
        density.reclaim_idle(node, args.idle_after)
        reclaim_s += time.perf_counter() - t0
        print(f"{len(ids)} held, MemAvailable {meminfo()['MemAvailable'] >> 20} MiB, "
              f"swap used {(_swap_used() - base_swap) >> 20} MiB", flush=True)
    ramp_s = time.monotonic() - t_start
    time.sleep(5)  # settles: nothing in the sandboxes runs, so nothing comes back
    used = _mem_used() - base_used
    usage = {sid: cgroup(sid).memory_use() for sid in ids}
    group = sum(u.get("resident", 0) for u in usage.values())
    swapped = sum(u.get("swapped", 0) for u in usage.values())
    swap_used = _swap_used() - base_swap
    load1 = os.getloadavg()
    # measured: now every sandbox must answer and still hold its bytes (in RAM or swap)
    alive, dead = 0, []
    for sid in ids:
        try:
            r = node.exec(sid, ["pidof", "dd"], timeout=60)
            ok = r.exit_code == 0 and r.stdout.strip() != b""
        except DsecError:
            ok = False
        u = usage[sid]
        if ok and u.get("resident", 0) + u.get("swapped", 0) >= (hold - 4) * MiB:
            alive += 1
        else:
            dead.append(sid)
    total_s = time.monotonic() - t_start
    # the same figure once they are gone: what else on the host changed meanwhile (another
    # process's memory moves MemAvailable too)
    remove_sandboxes()
    time.sleep(5)
    drift = _mem_used() - base_used
    res: dict[str, Any] = {
        "asked": n, "created": len(ids), "alive": alive, "not_alive": dead[:20],
        "stopped_early": stopped or None, "declared_mib_each": DECLARED >> 20,
        "hold_mib_each": hold, "memory_overcommit": ratio,
        "host_used_delta_mib": round(used / MiB, 1),
        "per_sandbox_host_mib": round(used / max(1, alive) / MiB, 2),
        "host_used_delta_after_removal_mib": round(drift / MiB, 1),
        "cgroup_resident_total_mib": round(group / MiB, 1),
        "per_sandbox_cgroup_mib": round(group / max(1, len(ids)) / MiB, 2),
        "cgroup_swapped_total_mib": round(swapped / MiB, 1),
        "swap_used_delta_mib": round(swap_used / MiB, 1),
        "bench_process_rss_delta_mib": round((_rss_self() - base_rss) / MiB, 1),
        "create_per_s": round(len(ids) / create_s, 2) if create_s else None,
        "ramp_s": round(ramp_s, 1), "reclaim_s": round(reclaim_s, 1),
        "total_s": round(total_s, 1),
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in load1]}
    for k, v in res.items():
        print(f"{k}: {v}")
    return res


def _rss_self() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0
