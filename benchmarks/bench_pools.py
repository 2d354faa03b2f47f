"""Warm pools and VM snapshot boot (on demand, as root), each against its own cold path in
the same run.

    python -m benchmarks pools [--n 40] [--threads 4] [--vm-runs 2] [--skip-vm]

Pools: container creations/s and create latency (p50/p99) with no pool, from a full pool
of N (a burst), and sustained from a pool of 8 refilled in the background while creates run.
VM: microvm create -> first exec answered, cold boot against a restore of the saved boot,
and QEMU's own bare restore of the same saved boot (to a running guest, no agent) as the floor.
Writes benchmarks/results/pools.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMAGE = "busybox@1.35-1"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def burst(node: Any, n: int, threads: int, opts: Any) -> dict[str, Any]:
    """n creates from `threads` threads: creations/s and per-create latency."""
    lat: list[float] = []

    def one(_: int) -> str:
        t = time.perf_counter()
        rec = node.create(IMAGE, opts)
        lat.append(time.perf_counter() - t)
        return str(rec.id)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        ids = list(ex.map(one, range(n)))
    wall = time.perf_counter() - t0
    for sid in ids:
        node.remove(sid)
    return {"per_s": n / wall, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def pools(n: int, threads: int) -> dict[str, Any]:
    from dsec_cli.build.builder import build
    from dsec_cli.run.node import CreateOptions, Node

    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    build([REPO / "layerspecs/busybox/busybox.yaml"], os.environ["DSEC_STORE"])
    opts = CreateOptions(memory=64 << 20, pids=64)
    # a budget that holds the whole pool (the default 2 GiB holds 32 members of 64 MiB)
    cfg = Path(os.environ["XDG_CONFIG_HOME"]) / "dsec" / "config.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f"pool: {{memory: {max(2 << 30, (n + 8) * opts.memory)}}}\n")
    node = Node()
    node.remove(node.create(IMAGE, CreateOptions()).id)  # materialize the layer once
    out: dict[str, Any] = {"n": n, "threads": threads}
    out["no_pool"] = burst(node, n, threads, opts)
    node.pools.set(IMAGE, opts, n)  # filled before the clock starts
    node.pools.stop()  # a burst from the members alone
    out["full_pool"] = burst(node, n, threads, opts)
    node.close()
    node = Node()  # a fresh refill thread
    node.pools.set(IMAGE, opts, 8)
    out["sustained_pool_8"] = burst(node, n, threads, opts)
    node.close()
    node.pools.drain()
    return out


def vm(runs: int, work: Path) -> dict[str, Any]:
    from dsec_cli.backends import ExecRequest, Limits, RootfsSpec, SandboxHandle, SandboxSpec
    from dsec_cli.backends.vm import vmsnap
    from dsec_cli.backends.vm.qemu import MicroVMBackend

    layer = work / "layer"
    (layer / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", layer / "bin" / "busybox")
    (layer / "bin" / "sh").symlink_to("busybox")
    (layer / "bin" / "true").symlink_to("busybox")
    node = work / "vmnode"

    def spec(sid: str) -> SandboxSpec:
        sdir = node / "sandboxes" / sid
        return SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec((layer,), sdir / "upper",
                                                             sdir / "work"),
                           state_dir=sdir, limits=Limits(memory=256 << 20),
                           image_digest="sha256:" + "d" * 64)

    def create_exec(b: MicroVMBackend, sid: str) -> float:
        t = time.perf_counter()
        h = b.create(spec(sid))
        b.exec(h, ExecRequest(["true"]))
        dt = time.perf_counter() - t
        b.destroy(h)
        return dt

    cold, snap = MicroVMBackend(node, boot="cold"), MicroVMBackend(node, boot="snapshot")
    t = time.perf_counter()
    snap.template_for(spec("warm"))  # the one-time boot and save, reported apart
    save_s = time.perf_counter() - t
    res: dict[str, list[float]] = {"cold": [], "snapshot": [], "bare_restore": []}
    for i in range(runs):  # interleaved, so load from others falls on all three alike
        res["cold"].append(create_exec(cold, f"c{i}"))
        res["snapshot"].append(create_exec(snap, f"s{i}"))
        res["bare_restore"].append(bare_restore(snap, spec(f"b{i}"), vmsnap, SandboxHandle))
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"runs": res, "median_s": med, "template_build_s": save_s,
            "snapshot_vs_cold": med["snapshot"] / med["cold"],
            "snapshot_vs_bare_restore": med["snapshot"] / med["bare_restore"]}


def bare_restore(b: Any, spec: Any, vmsnap: Any, handle_cls: Any) -> float:
    """QEMU alone: copy the disk, start with -incoming, wait for the guest to run."""
    tdir = b.template_for(spec)
    st = b._state(spec)
    spec.state_dir.mkdir(parents=True, exist_ok=True)
    Path(st["run_dir"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    kernel, initramfs, root = b._parts(spec)
    st["accel"] = b.acceleration(kernel)["accel"]
    h = handle_cls(spec.sandbox_id, b.name, st)
    t = time.perf_counter()
    vmsnap.copy_disk(tdir / "disk.ext4", Path(st["disk"]))
    argv = b._argv(spec, st, kernel, initramfs, root, Path(st["disk"]), snap=True)
    b._launch(spec, st, argv + vmsnap.incoming_argv(tdir))
    vmsnap.wait_restored(st["qmp"], 120, lambda: b.is_alive(h))
    dt = time.perf_counter() - t
    b.destroy(h)
    return dt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks pools")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--vm-runs", type=int, default=2)
    ap.add_argument("--skip-vm", action="store_true")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
    os.environ.update({"DSEC_STATE_DIR": str(tmp / "node"), "DSEC_STORE": (tmp / "store").as_uri(),
                       "XDG_DATA_HOME": str(tmp / "data"), "XDG_CONFIG_HOME": str(tmp / "cfg")})
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import save

    try:
        res: dict[str, Any] = {"load_avg_start": os.getloadavg()}
        res["pools"] = pools(args.n, args.threads)
        if not args.skip_vm:
            res["vm"] = vm(args.vm_runs, tmp)
        else:  # a run of the pools part alone keeps the last VM figures
            import json

            prev = Path(__file__).parent / "results" / "pools.json"
            if prev.is_file() and "vm" in json.loads(prev.read_text()):
                res["vm"] = json.loads(prev.read_text())["vm"]
        res["load_avg_end"] = os.getloadavg()
        print(save("pools", res))
        import json

        print(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
