"""Warm pools and VM snapshot boot (on demand, as root), each against its own cold path in
the same run.

    python -m benchmarks pools [--n 40] [--threads 4] [--vm-runs 2] [--skip-vm | --vm-only]

Pools: container creations/s and create latency (p50/p99) with no pool, from a full pool
of N (a burst), and sustained from a pool of 8 refilled in the background while creates run.
VM: microvm create -> first exec answered, cold boot against a restore of the saved boot,
and QEMU's own bare restore of the same saved boot, with the same command line and file, as
the floor: until the guest runs, and until its agent answers the same first exec.
Writes benchmarks/results/pools.json (pools_vm.json with --vm-only).
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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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

    def create_exec(b: MicroVMBackend, sid: str, spans: dict[str, list[float]] | None = None,
                    cpu: list[float] | None = None) -> float:
        t, c = time.perf_counter(), own_cpu()
        with timed_steps(b, spans):
            h = b.create(spec(sid))
            t1 = time.perf_counter()
            b.exec(h, ExecRequest(["true"]))
        dt = time.perf_counter() - t
        if spans is not None:
            spans.setdefault("first exec", []).append(time.perf_counter() - t1)
        if cpu is not None:
            cpu.append(own_cpu() - c + process_cpu(h.state["pid"]))
        b.destroy(h)
        return dt

    cold, snap = MicroVMBackend(node, boot="cold"), MicroVMBackend(node, boot="snapshot")
    t = time.perf_counter()
    snap.template_for(spec("warm"))  # the one-time boot and save, reported apart
    save_s = time.perf_counter() - t
    res: dict[str, list[float]] = {"cold": [], "snapshot": [], "bare_restore_running": [],
                                   "bare_restore_exec": [], "snapshot_cpu": [],
                                   "bare_restore_exec_cpu": []}
    spans: dict[str, list[float]] = {}
    for i in range(runs):  # interleaved, so load from others falls on all of them alike
        res["cold"].append(create_exec(cold, f"c{i}"))
        res["snapshot"].append(create_exec(snap, f"s{i}", spans, res["snapshot_cpu"]))
        running, answered, cpu = bare_restore(snap, spec(f"b{i}"), vmsnap, SandboxHandle)
        res["bare_restore_running"].append(running)
        res["bare_restore_exec"].append(answered)
        res["bare_restore_exec_cpu"].append(cpu)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"runs": res, "median_s": med, "template_build_s": save_s,
            "snapshot_steps_median_ms": {k: statistics.median(v) * 1e3 for k, v in spans.items()},
            # more than 1: a first connection got no answer within RESTORED_RETRY
            "agent_connections_per_restore": len(spans.get("agent connection", [])) / runs,
            "snapshot_vs_cold": med["snapshot"] / med["cold"],
            "snapshot_vs_bare_restore_exec": med["snapshot"] / med["bare_restore_exec"],
            "snapshot_vs_bare_restore_exec_cpu": med["snapshot_cpu"] / med["bare_restore_exec_cpu"],
            "snapshot_vs_bare_restore_running": med["snapshot"] / med["bare_restore_running"]}


@contextmanager
def timed_steps(b: Any, spans: dict[str, list[float]] | None) -> Iterator[None]:
    """Time the steps of a restore's create (each wrapped while the block runs)."""
    if spans is None:
        yield
        return
    from dsec_cli.backends import _cgroups
    from dsec_cli.backends.vm import vmsnap

    steps = [(type(b), "template_for", "template lookup"), (vmsnap, "copy_disk", "disk copy"),
             (type(b), "restore_argv", "command line"),
             (vmsnap, "open_state", "open stream"),
             (type(b), "_launch", "QEMU start until it daemonizes, with cgroup join"),
             (_cgroups.Cgroup, "add", "(of which cgroup join)"),
             (type(b), "_restore_identity", "load + agent's first answer (identity)"),
             (type(b), "_ping_within", "agent connection")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in steps]

    def wrap(f: Any, label: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spans.setdefault(label, []).append(time.perf_counter() - t)
        return timed

    for (obj, name, label), (_, _, f) in zip(steps, saved, strict=True):
        setattr(obj, name, wrap(f, label))
    try:
        yield
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)


def own_cpu() -> float:
    """CPU seconds of this process and its reaped children (cp, QEMU's daemonizing parent)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def process_cpu(pid: int) -> float:
    """CPU seconds a running process (a daemonized QEMU) has used."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def bare_restore(b: Any, spec: Any, vmsnap: Any, handle_cls: Any
                 ) -> tuple[float, float, float]:
    """QEMU alone, with the command line and stream file a dsec restore uses: copy the disk,
    start QEMU loading the stream, and time (1) until QEMU reports the guest running and
    (2) until the guest's agent answers the same first exec (`true`) over a bare
    connection: no identity, no cgroup, no client set-up. Two launches, one per measure;
    and the CPU time (this process and QEMU) the second took, which load from other work on
    the host does not inflate as it does wall time."""
    from dsec_cli.backends.sandbox_agent.client import AgentClient
    from dsec_cli.backends.vm.qemu_qmp import QMPError, qmp

    tdir = b.template_for(spec)
    out = []
    for measure in ("running", "exec"):
        st = b._state(spec)
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        Path(st["run_dir"]).mkdir(mode=0o700, parents=True, exist_ok=True)
        h = handle_cls(spec.sandbox_id, b.name, st)
        argv = b.restore_argv(spec, st)
        try:
            t, c = time.perf_counter(), own_cpu()
            vmsnap.copy_disk(tdir / "disk.ext4", Path(st["disk"]))
            fd = vmsnap.open_state(tdir)
            subprocess.run(argv + vmsnap.incoming_fd_argv(fd), check=True, pass_fds=(fd,),
                           capture_output=True)
            os.close(fd)
            if measure == "running":
                while True:
                    try:
                        if (qmp(st["qmp"], "query-status") or {}).get("status") == "running":
                            break
                    except QMPError:
                        pass
                    time.sleep(0.005)
            else:
                st["pid"] = int(Path(st["pidfile"]).read_text())
                client = AgentClient.connect_unix(st["agent_sock"], peer=lambda pid: True)
                r = client.exec(["true"], {}, "/", None, 60)
                assert r.exit_code == 0, r
                client.close()
            out.append(time.perf_counter() - t)
            if measure == "exec":
                out.append(own_cpu() - c + process_cpu(st["pid"]))
        finally:
            b.destroy(h)
    return out[0], out[1], out[2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks pools")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--vm-runs", type=int, default=2)
    ap.add_argument("--skip-vm", action="store_true")
    ap.add_argument("--vm-only", action="store_true",
                    help="only the VM part, written to benchmarks/results/pools_vm.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
    os.environ.update({"DSEC_STATE_DIR": str(tmp / "node"), "DSEC_STORE": (tmp / "store").as_uri(),
                       "XDG_DATA_HOME": str(tmp / "data"), "XDG_CONFIG_HOME": str(tmp / "cfg")})
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import save

    try:
        res: dict[str, Any] = {"load_avg_start": os.getloadavg()}
        if not args.vm_only:
            res["pools"] = pools(args.n, args.threads)
        if not args.skip_vm:
            res["vm"] = vm(args.vm_runs, tmp)
        else:  # a run of the pools part alone keeps the last VM figures
            import json

            prev = Path(__file__).parent / "results" / "pools.json"
            if prev.is_file() and "vm" in json.loads(prev.read_text()):
                res["vm"] = json.loads(prev.read_text())["vm"]
        res["load_avg_end"] = os.getloadavg()
        print(save("pools_vm" if args.vm_only else "pools", res))
        import json

        print(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
