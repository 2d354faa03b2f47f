"""Which QEMU accelerator actually runs guests here: KVM or TCG.

`/dev/kvm` existing (or even opening) is not enough: in some nested setups KVM runs real
mode and then stalls when the kernel enters protected mode. So the probe boots the real
guest kernel with `-accel kvm` into an init that powers off at once, under a short
timeout; the answer is cached per node in the state dir.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

from .vmkernel import Kernel, boot_image, build_initramfs

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 15.0  # a working KVM boots this guest in about a second
MARKER = b"dsec-guest-up"


def floor_argv(qemu: str, image: Path, initramfs: Path, accel: str,
               machine: str = "microvm", append: str = "") -> list[str]:
    """QEMU booting `kernel` straight into the power-off init: the probe, and the floor
    the benchmarks compare guest boots against."""
    return [qemu, "-M", machine, "-accel", accel, "-cpu", "host" if accel == "kvm" else "max",
            "-m", "256M", "-nodefaults", "-no-user-config", "-display", "none",
            "-no-reboot", "-serial", "stdio", "-kernel", str(image),
            "-initrd", str(initramfs), "-append", f"console=ttyS0 quiet panic=-1 {append}"]


def probe_kvm(qemu: str, kernel: Kernel, cache_dir: Path) -> tuple[bool, str]:
    """(works, why) for KVM, by booting a guest under it."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    initramfs = build_initramfs(kernel, cache_dir, init="poweroff.sh")
    image = boot_image(kernel, cache_dir)
    start = time.monotonic()
    try:
        out = subprocess.run(floor_argv(qemu, image, initramfs, "kvm"), capture_output=True,
                             timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return False, f"a KVM guest did not boot within {PROBE_TIMEOUT:.0f}s"
    if MARKER in out.stdout:
        return True, f"a KVM guest booted in {time.monotonic() - start:.1f}s"
    err = out.stderr.decode(errors="replace").strip().splitlines()
    return False, f"a KVM guest failed to boot: {err[-1] if err else f'exit {out.returncode}'}"


def accelerator(qemu: str, kernel: Kernel, state_dir: Path, cache_dir: Path) -> dict[str, str]:
    """{"accel": "kvm"|"tcg", "reason": ...}, probed once per node and cached."""
    path = state_dir / "accel.json"
    try:
        cached: dict[str, str] = json.loads(path.read_text())
        if cached.get("accel") in ("kvm", "tcg"):
            return cached
    except (OSError, ValueError):
        pass
    works, why = probe_kvm(qemu, kernel, cache_dir)
    result = {"accel": "kvm" if works else "tcg", "reason": why}
    log.info("VM acceleration: %s (%s)", result["accel"], why)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".accel.{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result
