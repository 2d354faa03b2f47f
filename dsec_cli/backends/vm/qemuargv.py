"""The QEMU command line of a guest: the kernel's command line, the devices of its machine
type, its CPUs, memory, disks, agent port and network, and the checks a spec passes before
anything is started. What the two backends differ in is their `Machine`."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ...core.config import env
from ...core.errors import UsageError
from .. import egress
from ..base import Limits, SandboxSpec
from . import vmimage
from .qemuproc import qemu_name

DEFAULT_MEMORY = 512 << 20
MIN_MEMORY = 128 << 20


class Machine(Protocol):
    """A machine type and its device models (`MicroVMBackend`, `VMBackend`)."""

    machine: ClassVar[str]
    blk_dev: ClassVar[str]
    serial_dev: ClassVar[str]
    balloon_dev: ClassVar[str]
    net_dev: ClassVar[str]


def qemu_argv(m: Machine, binary: str, spec: SandboxSpec, st: dict[str, Any], kernel: Path,
              initramfs: Path, root: Path, disk: Path, snap: bool = False) -> list[str]:
    """QEMU's command line for a guest of machine ``m`` booting ``kernel`` (its boot image)
    and ``initramfs`` over ``root`` and ``disk``; ``snap`` for a guest saved or restored as a
    template. Paths come from the handle state ``st``."""
    lim = spec.limits
    cpus = max(1, math.ceil(lim.cpus)) if lim.cpus else 1
    mem = lim.memory or DEFAULT_MEMORY
    accel = st["accel"]
    # the -name argument is also how is_alive tells our QEMU from a reused pid
    argv = [binary, "-name", qemu_name(spec.sandbox_id).decode(),
            # guest RAM is QEMU's private anonymous memory, marked mergeable for KSM
            "-M", f"{m.machine},mem-merge=on", "-accel", accel,
            "-cpu", "host" if accel == "kvm" else "max",
            "-smp", str(cpus), "-m", f"{mem >> 20}M",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-daemonize", "-pidfile", st["pidfile"],
            "-kernel", str(kernel),
            "-initrd", str(initramfs),
            "-append", kernel_cmdline(spec, accel),
            "-serial", f"file:{st['console']}",
            "-qmp", f"unix:{st['qmp']},server=on,wait=off",
            "-drive", f"if=none,id=root,file={root},format=raw,readonly=on",
            "-device", f"{m.blk_dev},drive=root",
            "-drive", f"if=none,id=disk,file={disk},format=raw",
            "-device", f"{m.blk_dev},drive=disk",
            "-chardev", f"socket,id=agent,path={st['agent_sock']},server=on,wait=off",
            "-device", m.serial_dev,
            "-device", "virtserialport,chardev=agent,name=dsec.agent",
            # pages the guest frees are reported and dropped from QEMU's RAM: an idle
            # VM's resident memory is what its guest really holds (docs/density.md)
            "-device", f"{m.balloon_dev},free-page-reporting=on"]
    if spec.network == "host":
        argv += ["-netdev", "user,id=net0", "-device", f"{m.net_dev},netdev=net0"]
    elif spec.network == "allowlist":
        # the tap of the VM's own namespace, bridged to its filtered link (egress.py):
        # QEMU is started in that namespace (`_launch`)
        argv += ["-netdev", f"tap,id=net0,ifname={egress.TAP},script=no,downscript=no",
                 "-device", f"{m.net_dev},netdev=net0"]
    if snap:
        # a new generation id per restore: where the guest's firmware tables expose it
        # (q35), the kernel reseeds its CRNG the moment the guest resumes
        argv += ["-device", "vmgenid,guid=auto",
                 # the saved stream then carries no run state ("paused": the guest is
                 # stopped to be saved), so a restore runs the guest once it is loaded
                 # instead of waiting for a `cont`
                 "-global", "migration.store-global-state=off"]
    return argv


def kernel_cmdline(spec: SandboxSpec, accel: str) -> str:
    """The guest kernel's command line: what its init reads (root, hostname, network, pids
    limit) and the clock and memory settings this host wants."""
    args = ["console=ttyS0", "panic=-1", "rdinit=/init", "dsec.root=erofs",
            f"dsec.hostname={safe_hostname(spec.hostname)}"]
    if not env("DSEC_VM_VERBOSE"):  # the full kernel log, for boot problems
        args.append("quiet")
    if accel == "tcg":
        khz = host_tsc_khz()
        if khz:
            args += [f"tsc_early_khz={khz}", "tsc=reliable"]
    if spec.network == "host":
        args.append("dsec.net=1")
    if spec.limits.pids:
        args.append(f"dsec.pids={int(spec.limits.pids)}")
    if ksm_on():
        # pages the guest frees are zeroed, so KSM merges them (with the zero page where
        # use_zero_pages is set) instead of keeping each guest's garbage resident
        args.append("init_on_free=1")
    return " ".join(args)


def check_spec(spec: SandboxSpec) -> None:
    """Reject bad input before anything is created."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", spec.sandbox_id):
        raise UsageError(f"invalid sandbox id {spec.sandbox_id!r}: use letters, digits, "
                         "'.', '_' and '-' (at most 64)")
    if spec.network not in ("none", "host", "allowlist"):
        raise UsageError(f"unknown network policy {spec.network!r}: choose none, host or "
                         "allowlist")
    lim = spec.limits
    if lim.memory is not None and lim.memory < MIN_MEMORY:
        raise UsageError(f"memory limit {lim.memory} bytes is too small for a VM "
                         "(minimum 128 MiB)")
    if lim.pids is not None and lim.pids < 8:
        raise UsageError(f"pids limit {lim.pids} is too small (minimum 8)")
    if lim.cpus is not None and lim.cpus <= 0:
        raise UsageError(f"cpu limit {lim.cpus} must be positive")
    if lim.disk is not None and lim.disk < vmimage.MIN_DISK:
        raise UsageError(f"disk limit {lim.disk} bytes is too small for a VM (minimum 16 MiB)")
    for d in spec.rootfs.lower_dirs:
        if not Path(d).is_dir():
            raise UsageError(f"rootfs layer directory {str(d)!r} does not exist")


def guest_shape(limits: Limits, hostname: str = "sandbox") -> dict[str, Any]:
    """What of a guest's spec its QEMU command line holds besides paths (its CPUs, memory,
    pids limit, hostname), kept in its handle state so a parked guest's command line is
    built again (`QemuBackend.parked_argv`)."""
    return {"cpus": limits.cpus, "memory": limits.memory, "pids": limits.pids,
            "hostname": safe_hostname(hostname)}


def ksm_on() -> bool:
    """Whether the host's same-page merging runs now (`dsec node setup --ksm`)."""
    try:
        return Path("/sys/kernel/mm/ksm/run").read_text().strip() == "1"
    except OSError:
        return False


def without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less the given options and their values."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a in options:
            next(it, None)
        else:
            out.append(a)
    return out


def safe_hostname(name: str) -> str:
    cleaned = "".join(ch for ch in name if ch.isalnum() or ch in "-.")[:63]
    return cleaned or "sandbox"


def host_tsc_khz() -> int | None:
    """Under TCG the guest reads the host's TSC; telling the guest kernel its rate skips
    a calibration that hangs on microvm (no PIT or HPET to calibrate against)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None
