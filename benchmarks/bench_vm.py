"""microvm and vm backends: boot to agent-ready and exec round trip, against the floor.

The floor is QEMU booting the same kernel, on the same machine type and accelerator,
straight into an init that powers off: no disks, no overlay, no agent. Ratios say what
dsec adds on top of the kernel boot itself.

    python -m benchmarks vm [--runs N] [--execs N] [--backends microvm,vm]
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

from benchmarks.common import REPO, save
from dsec_cli.backends import ExecRequest, Limits, RootfsSpec, SandboxSpec, get_backend
from dsec_cli.backends.vm.qemu import QemuBackend
from dsec_cli.backends.vm.qemu_accel import floor_argv
from dsec_cli.backends.vm.qemuargv import host_tsc_khz
from dsec_cli.backends.vm.vmkernel import boot_image, build_initramfs, find_kernel

MACHINES = {"microvm": "microvm,x-option-roms=off", "vm": "q35"}


def busybox_layer(dest: Path) -> Path:
    (dest / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", dest / "bin" / "busybox")
    for a in subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True,
                            check=True).stdout.split():
        if a != "busybox":
            (dest / "bin" / a).symlink_to("busybox")
    (dest / "etc").mkdir()
    return dest


def floor_cmd(backend: QemuBackend, name: str, work: Path) -> list[str]:
    kernel = find_kernel()
    accel = backend.acceleration(kernel)["accel"]
    initramfs = build_initramfs(kernel, work / "initramfs", init="poweroff.sh")
    khz = host_tsc_khz()
    append = f"tsc_early_khz={khz} tsc=reliable" if accel == "tcg" and khz else ""
    image = boot_image(kernel, work / "kernel")  # the same image the backends boot
    return floor_argv(backend._qemu_binary(), image, initramfs, accel, MACHINES[name], append)


def floor_once(argv: list[str]) -> float:
    t = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, timeout=600)
    took = time.perf_counter() - t
    assert b"dsec-guest-up" in out.stdout, out.stderr[-500:]
    return took


def interleaved(backend: QemuBackend, layer: Path, runs: int, execs: int, work: Path
                ) -> tuple[list[float], list[float], list[float]]:
    """Floor boots and sandbox boots alternate, so load from other work on the host
    weighs on both alike."""
    argv = floor_cmd(backend, backend.name, work)
    floor: list[float] = []
    ready: list[float] = []
    rtt: list[float] = []
    for i in range(runs):
        floor.append(floor_once(argv))
        sdir = work / "sandboxes" / f"{backend.name}{i}"
        spec = SandboxSpec(f"bench{backend.name}{i}", RootfsSpec((layer,), sdir / "u", sdir / "w"),
                           sdir, limits=Limits(cpus=1, memory=256 << 20),
                           image_digest="sha256:" + "b" * 64)
        t = time.perf_counter()
        h = backend.create(spec)
        ready.append(time.perf_counter() - t)
        try:
            if i == runs - 1:
                for _ in range(execs):
                    t = time.perf_counter()
                    backend.exec(h, ExecRequest(["true"]))
                    rtt.append(time.perf_counter() - t)
        finally:
            backend.destroy(h)
    return floor, ready, rtt


def main(args: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vm")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--backends", default="microvm,vm")
    opts = ap.parse_args(args)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-vm-") as tmp:
        work = Path(tmp)
        layer = busybox_layer(work / "layer")
        for name in opts.backends.split(","):
            backend = get_backend(name, state_dir=work / "node")
            assert isinstance(backend, QemuBackend)
            warm = SandboxSpec(f"warm{name}", RootfsSpec((layer,), work / "wu", work / "ww"),
                               work / "warm" / name, image_digest="sha256:" + "b" * 64)
            backend.destroy(backend.create(warm))
            fl, ready, rtt = interleaved(backend, layer, opts.runs, opts.execs, work)
            f_med, r_med = statistics.median(fl), statistics.median(ready)
            results[name] = {
                "accel": backend.acceleration()["accel"],
                "floor_boot_s": {"median": f_med, "runs": fl},
                "ready_s": {"median": r_med, "runs": ready},
                "ready_over_floor": r_med / f_med,
                "exec_rtt_ms": {"median": statistics.median(rtt) * 1000,
                                "p90": sorted(rtt)[int(len(rtt) * 0.9)] * 1000, "n": len(rtt)},
            }
            print(f"{name}: floor {f_med:.2f}s, ready {r_med:.2f}s "
                  f"({r_med / f_med:.2f}x floor), exec rtt "
                  f"{results[name]['exec_rtt_ms']['median']:.1f} ms ({results[name]['accel']})")
    load = os.getloadavg()
    out = save("vm", {"runs": opts.runs, "loadavg_after": load, "backends": results})
    print(f"results: {out.relative_to(REPO)}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
