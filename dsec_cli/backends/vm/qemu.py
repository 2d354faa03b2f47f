"""The `microvm` and `vm` backends: a QEMU guest per sandbox, reached through dsec-agent.

Create = build (or reuse) the image's read-only root disk, make the sandbox's sparse
writable disk, and start QEMU detached (`-daemonize`: it outlives any dsec process and
dsec finds it again through the handle's state). The guest kernel boots an initramfs
whose init mounts root image + writable disk under overlayfs and runs dsec-agent chrooted
in it on the `dsec.agent` virtio-serial port, whose host end is a unix socket. Exec, put
and get go over that socket; pause and resume are QMP stop/cont; snapshot syncs the guest,
stops it and reads the writable disk's ``upper/`` from the host; destroy is QMP quit,
then SIGKILL, never leaving a QEMU process or a mount behind.

`microvm` is QEMU's `-M microvm` (virtio-mmio, qboot, no PCI); `vm` is a q35 PC with
SeaBIOS and virtio-pci. Both use KVM when it really runs guests (see qemu_accel), TCG
otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ...core.config import env, load_config
from ...core.errors import BackendError, ConfigError, SandboxError, UsageError
from ...core.rundir import (
    check_private,
    open_beneath,
    private_dir,
    runtime_dir,
    socket_is_ours,
)
from .. import _cgroups, egress
from ..agented import AgentBackend
from ..base import (
    BackendContext,
    ExecRequest,
    ExecResult,
    Limits,
    OutputCallback,
    RootfsSpec,
    SandboxHandle,
    SandboxSpec,
)
from ..sandbox_agent import agent_binary, agent_tag
from ..sandbox_agent.client import AgentClient, AgentError
from . import qemu_accel, vmimage, vmpark, vmsnap
from .qemu_qmp import QMPError, qmp
from .vmkernel import Kernel, boot_image, build_initramfs, find_kernel

log = logging.getLogger(__name__)

DEFAULT_MEMORY = 512 << 20
MIN_MEMORY = 128 << 20
#: how long one connection waits for the agent's answer before it is made again
AGENT_RETRY = 10.0
#: the same for a guest just restored: its agent may still be reopening its port after the
#: template's connection went away, which can swallow the first request
RESTORED_RETRY = 1.0
BOOT_TIMEOUT = 180.0  # TCG on a loaded 2-core host boots in tens of seconds
CONNECT_TIMEOUT = 60.0  # waiting for another process to release the agent connection
#: the longest path a unix socket can be bound at (sun_path holds 108 bytes with its NUL)
SOCKET_PATH_MAX = 107


def _host_tsc_khz() -> int | None:
    """Under TCG the guest reads the host's TSC; telling the guest kernel its rate skips
    a calibration that hangs on microvm (no PIT or HPET to calibrate against)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def _proc_start(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


class QemuBackend(AgentBackend):
    """Shared driver; subclasses choose the machine type and its device models."""

    machine: ClassVar[str] = ""
    blk_dev: ClassVar[str] = ""
    serial_dev: ClassVar[str] = ""
    balloon_dev: ClassVar[str] = ""
    net_dev: ClassVar[str] = ""

    supports_pause = True  # QMP stop / cont
    supports_snapshot = True  # upper/ read back from the guest's disk
    is_vm = True
    park_mechanism = "state-file"  # backends/vm/vmpark.py: QEMU migrates to a file
    member_estimate = 512 << 20  # the guest's RAM as it boots and settles
    #: a restore starts QEMU without the kernel and initramfs: the guest read them at its boot
    #: (through fw_cfg; the saved RAM holds what it kept), and reading and loading them is
    #: most of QEMU's own start (~190 ms of CPU here)
    restore_without_kernel: ClassVar[bool] = True

    @classmethod
    def from_context(cls, ctx: BackendContext) -> QemuBackend:
        # root images and the accelerator probe are kept per node
        return cls(ctx.state_dir, ctx.kernel, cgroup_parent=ctx.cgroup_parent)

    def __init__(self, state_dir: str | os.PathLike[str] | None = None,
                 kernel: str | os.PathLike[str] | None = None,
                 qemu: str = "qemu-system-x86_64", accel: str = "auto",
                 boot_timeout: float = BOOT_TIMEOUT, boot: str | None = None,
                 cgroup_parent: str = "dsec") -> None:
        self.cgroup_parent = cgroup_parent  # QEMU runs in <parent>/<sandbox id>
        if accel not in ("auto", "kvm", "tcg"):
            raise UsageError(f"unknown accelerator {accel!r}: choose auto, kvm or tcg")
        cfg = load_config() if boot is None or not state_dir else None
        boot = boot or (cfg.vm_boot if cfg else "cold")
        if boot not in ("cold", "snapshot"):
            raise UsageError(f"unknown VM boot mode {boot!r} (vm_boot, DSEC_VM_BOOT): choose "
                             "cold or snapshot")
        self.boot = boot
        root = Path(state_dir) if state_dir else Path(cfg.state_dir if cfg else ".")
        self.vm_dir = root / "vm"  # node-level: accel probe, initramfs, root images
        self.kernel_path = kernel
        self._resolved_kernel: Kernel | None = None
        self._initramfs: Path | None = None
        self.qemu = qemu
        self.accel = accel
        self.boot_timeout = boot_timeout
        super().__init__()

    # -- helpers -------------------------------------------------------------------------------
    def _kernel(self) -> Kernel:
        # resolved once per backend: finding it reads the config files and globs the cache
        if self._resolved_kernel is None:
            self._resolved_kernel = find_kernel(self.kernel_path)
        return self._resolved_kernel

    def _qemu_binary(self) -> str:
        path = shutil.which(self.qemu)
        if path is None:
            raise BackendError(f"{self.qemu} is not installed",
                               hint="run scripts/setup.sh (apt: qemu-system-x86)")
        return path

    def acceleration(self, kernel: Kernel | None = None) -> dict[str, str]:
        if self.accel != "auto":
            return {"accel": self.accel, "reason": "chosen by configuration"}
        return qemu_accel.accelerator(self._qemu_binary(), kernel or self._kernel(),
                                      self.vm_dir, self.vm_dir / "initramfs")

    def _cmdline(self, spec: SandboxSpec, accel: str) -> str:
        args = ["console=ttyS0", "panic=-1", "rdinit=/init", "dsec.root=erofs",
                f"dsec.hostname={_safe_hostname(spec.hostname)}"]
        if not env("DSEC_VM_VERBOSE"):  # the full kernel log, for boot problems
            args.append("quiet")
        if accel == "tcg":
            khz = _host_tsc_khz()
            if khz:
                args += [f"tsc_early_khz={khz}", "tsc=reliable"]
        if spec.network == "host":
            args.append("dsec.net=1")
        if spec.limits.pids:
            args.append(f"dsec.pids={int(spec.limits.pids)}")
        if _ksm_on():
            # pages the guest frees are zeroed, so KSM merges them (with the zero page where
            # use_zero_pages is set) instead of keeping each guest's garbage resident
            args.append("init_on_free=1")
        return " ".join(args)

    def _validate(self, spec: SandboxSpec) -> None:
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
        self._qemu_binary()

    def _argv(self, spec: SandboxSpec, st: dict[str, Any], kernel: Kernel, initramfs: Path,
              root: Path, disk: Path, snap: bool = False) -> list[str]:
        lim = spec.limits
        cpus = max(1, math.ceil(lim.cpus)) if lim.cpus else 1
        mem = lim.memory or DEFAULT_MEMORY
        accel = st["accel"]
        # the -name argument is also how is_alive tells our QEMU from a reused pid
        argv = [self._qemu_binary(), "-name", _qemu_name(spec.sandbox_id).decode(),
                # guest RAM is QEMU's private anonymous memory, marked mergeable for KSM
                "-M", f"{self.machine},mem-merge=on", "-accel", accel,
                "-cpu", "host" if accel == "kvm" else "max",
                "-smp", str(cpus), "-m", f"{mem >> 20}M",
                "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
                "-daemonize", "-pidfile", st["pidfile"],
                "-kernel", str(boot_image(kernel, self.vm_dir / "kernel")),
                "-initrd", str(initramfs),
                "-append", self._cmdline(spec, accel),
                "-serial", f"file:{st['console']}",
                "-qmp", f"unix:{st['qmp']},server=on,wait=off",
                "-drive", f"if=none,id=root,file={root},format=raw,readonly=on",
                "-device", f"{self.blk_dev},drive=root",
                "-drive", f"if=none,id=disk,file={disk},format=raw",
                "-device", f"{self.blk_dev},drive=disk",
                "-chardev", f"socket,id=agent,path={st['agent_sock']},server=on,wait=off",
                "-device", self.serial_dev,
                "-device", "virtserialport,chardev=agent,name=dsec.agent",
                # pages the guest frees are reported and dropped from QEMU's RAM: an idle
                # VM's resident memory is what its guest really holds (docs/density.md)
                "-device", f"{self.balloon_dev},free-page-reporting=on"]
        if spec.network == "host":
            argv += ["-netdev", "user,id=net0", "-device", f"{self.net_dev},netdev=net0"]
        elif spec.network == "allowlist":
            # the tap of the VM's own namespace, bridged to its filtered link (egress.py):
            # QEMU is started in that namespace (`_launch`)
            argv += ["-netdev", f"tap,id=net0,ifname={egress.TAP},script=no,downscript=no",
                     "-device", f"{self.net_dev},netdev=net0"]
        if snap:
            # a new generation id per restore: where the guest's firmware tables expose it
            # (q35), the kernel reseeds its CRNG the moment the guest resumes
            argv += ["-device", "vmgenid,guid=auto",
                     # the saved stream then carries no run state ("paused": the guest is
                     # stopped to be saved), so a restore runs the guest once it is loaded
                     # instead of waiting for a `cont`
                     "-global", "migration.store-global-state=off"]
        return argv

    # -- lifecycle -----------------------------------------------------------------------------
    def create(self, spec: SandboxSpec) -> SandboxHandle:
        self._validate(spec)
        self._kernel()  # a missing kernel is bad input: refused before anything is made
        if self.boot == "snapshot":
            try:
                return self._create_restored(spec)
            except (BackendError, SandboxError, OSError) as e:  # cold boot: the fallback
                log.warning("sandbox %s: snapshot boot failed (%s); booting cold",
                            spec.sandbox_id, e)
        return self._create_cold(spec)

    def _state(self, spec: SandboxSpec) -> dict[str, Any]:
        return {**_default_state(spec.sandbox_id, str(spec.state_dir)), "machine": self.name,
                "env": dict(spec.env), "workdir": spec.workdir, "network": spec.network,
                "cgroup": f"{self.cgroup_parent}/{spec.sandbox_id}",
                "guest": guest_shape(spec.limits, spec.hostname)}

    def _parts(self, spec: SandboxSpec) -> tuple[Kernel, Path, Path]:
        kernel = self._kernel()
        root = vmimage.root_image(spec.rootfs.lower_dirs, spec.image_digest,
                                  self.vm_dir / "images")
        return kernel, self._initramfs_file(kernel), root

    def _initramfs_file(self, kernel: Kernel) -> Path:
        # found once per backend (finding it walks the kernel's module tree: ~0.1 s), like
        # the kernel; made again if node gc removed it
        if self._initramfs is None or not self._initramfs.is_file():
            self._initramfs = build_initramfs(kernel, self.vm_dir / "initramfs",
                                              agent=agent_binary())
        return self._initramfs

    def _launch(self, spec: SandboxSpec, st: dict[str, Any], argv: list[str],
                pass_fds: tuple[int, ...] = ()) -> None:
        if spec.network == "allowlist":
            # the link and its filter exist before the guest does; rules as asked (none
            # for a template's boot: what a snapshot keeps must not depend on them)
            egress.make_netns(spec.sandbox_id)
            st["egress"] = egress.attach(spec.sandbox_id, egress.names(spec.sandbox_id)["netns"],
                                         list(spec.egress), spec.state_dir, guest=True)
            argv = [*egress.netns_argv(spec.sandbox_id), *argv]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              pass_fds=pass_fds)
        if proc.returncode != 0:
            raise BackendError(f"QEMU could not start sandbox {spec.sandbox_id}: "
                               f"{proc.stderr.strip()[-1000:]}")
        pid = int(Path(st["pidfile"]).read_text().strip())
        st["pid"], st["start_time"] = pid, _proc_start(pid)
        # QEMU (every thread, guest RAM charged from here on) in the sandbox's own group:
        # its CPU class, resident memory and reclamation act on it
        cg = _cgroups.Cgroup(st["cgroup"])
        cg.create()
        cg.add(pid)
        if spec.limits.cpu_class:
            cg.apply_class(spec.limits.cpu_class)

    def _create_cold(self, spec: SandboxSpec, snap: bool = False) -> SandboxHandle:
        sdir = spec.state_dir
        st = self._state(spec)
        handle = SandboxHandle(spec.sandbox_id, self.name, st)
        try:
            sdir.mkdir(parents=True, exist_ok=True)
            make_run_dir(st)
            kernel, initramfs, root = self._parts(spec)
            disk = vmimage.writable_disk(Path(st["disk"]), spec.limits.disk)
            acc = self.acceleration(kernel)
            st["accel"], st["root_image"] = acc["accel"], str(root)
            self._launch(spec, st, self._argv(spec, st, kernel, initramfs, root, disk, snap))
            self._wait_ready(handle)
            if not snap:
                self._use_link(handle)
        except BaseException:
            self.destroy(handle)
            raise
        return handle

    # -- snapshot boot (vmsnap.py) -------------------------------------------------------------
    def _template(self, spec: SandboxSpec) -> tuple[str, str, Path]:
        """The template's key, the document it digests, and its directory."""
        kernel, initramfs, root = self._parts(spec)
        accel = self.acceleration(kernel)["accel"]
        lim = spec.limits
        key, doc = vmsnap.template_key(
            {"machine": self.machine, "accel": accel, "cpus": lim.cpus,
             "memory": lim.memory or DEFAULT_MEMORY, "pids": lim.pids, "disk": lim.disk,
             "network": spec.network, "agent": agent_tag()},
            [boot_image(kernel, self.vm_dir / "kernel"), initramfs, root,
             Path(self._qemu_binary())])
        return key, doc, vmsnap.template_dir(self.vm_dir, key)

    def template_for(self, spec: SandboxSpec) -> Path:
        """The saved boot a sandbox like ``spec`` restores from; built (by booting a guest
        under ``<sandbox id>-tpl`` in a build dir named after the sandbox) when missing."""
        key, doc, tdir = self._template(spec)
        if vmsnap.ready(tdir):
            return tdir
        with vmsnap.build_lock(self.vm_dir, key):
            if vmsnap.ready(tdir):
                return tdir
            work = vmsnap.build_dir(self.vm_dir, spec.sandbox_id)
            tspec = dataclasses.replace(spec, sandbox_id=_template_id(spec.sandbox_id),
                                        state_dir=work / "vm", hostname="sandbox", env={},
                                        egress=())
            out = work / "out"
            out.mkdir(parents=True, exist_ok=True)
            (out / "key.json").write_text(doc + "\n")
            h = self._create_cold(tspec, snap=True)
            try:
                self._drop_client(h.sandbox_id)  # the guest's port must not hold a connection
                time.sleep(0.5)  # let the agent see the port close and reopen it before the stop
                vmsnap.save(h.state["qmp"], out / "state", self.boot_timeout)
                qmp(h.state["qmp"], "quit", timeout=5)
                _wait_gone(h.state["pid"], 30.0)
                os.rename(h.state["disk"], out / "disk.ext4")
            finally:
                self.destroy(h)
            tdir.parent.mkdir(parents=True, exist_ok=True)
            os.rename(out, tdir)
            shutil.rmtree(work, ignore_errors=True)
        return tdir

    def _create_restored(self, spec: SandboxSpec) -> SandboxHandle:
        tdir = self.template_for(spec)
        vmsnap.touch(tdir)
        sdir = spec.state_dir
        st = self._state(spec)
        st["restored"] = tdir.name
        handle = SandboxHandle(spec.sandbox_id, self.name, st)
        try:
            sdir.mkdir(parents=True, exist_ok=True)
            make_run_dir(st)
            vmsnap.copy_disk(tdir / "disk.ext4", Path(st["disk"]))
            st["root_image"] = str(self._parts(spec)[2])
            argv = self.restore_argv(spec, st)
            fd = vmsnap.open_state(tdir)
            try:
                self._launch(spec, st, argv + vmsnap.incoming_fd_argv(fd), pass_fds=(fd,))
            finally:
                os.close(fd)
            # no wait for the load: the agent's answer is the sign the guest runs, and a
            # failed load ends QEMU, which the wait notices
            self._restore_identity(handle, spec)
            self._use_link(handle)
        except BaseException:
            self.destroy(handle)
            raise
        return handle

    def _use_link(self, handle: SandboxHandle) -> None:
        """An allowlist guest's eth0 gets its address and route (not on the kernel command
        line: a restored guest shares its template's)."""
        eg = handle.state.get("egress")
        if not eg:
            return
        r = self.client(handle).exec(egress.guest_setup(eg), {}, "/", b"", 60)
        if r.exit_code != 0:
            raise SandboxError(f"configuring the network of sandbox {handle.sandbox_id} "
                               f"failed: {r.stderr.decode(errors='replace').strip()}")
        self.pin_names(handle)

    def restore_argv(self, spec: SandboxSpec, st: dict[str, Any]) -> list[str]:
        """QEMU's command line for restoring a template for ``spec`` (add the ``-incoming``
        argument); sets ``st["accel"]``."""
        kernel, _, root = self._parts(spec)
        st["accel"] = self.acceleration(kernel)["accel"]
        return self._guest_argv(spec, st, root, restored=True)

    def parked_argv(self, sid: str, st: dict[str, Any]) -> list[str]:
        """QEMU's command line for a guest parked to a state file (add ``-S -incoming``):
        the one its create ran, built again from its handle state (guest shape, network,
        accelerator, root image, whether it was restored) with this node's QEMU, kernel and
        paths. No command line is ever saved or taken from a state file."""
        g = st.get("guest") or {}
        spec = SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec((), Path(), Path()),
                           state_dir=Path(st["state_dir"]), network=st.get("network", "none"),
                           limits=Limits(cpus=g.get("cpus"), memory=g.get("memory"),
                                         pids=g.get("pids")),
                           hostname=g.get("hostname") or "sandbox")
        return self._guest_argv(spec, st, Path(st["root_image"]), bool(st.get("restored")))

    def _guest_argv(self, spec: SandboxSpec, st: dict[str, Any], root: Path,
                    restored: bool) -> list[str]:
        """The command line of a guest restored from a saved boot (``restored``) or of one
        booted cold; either way without ``-incoming``."""
        kernel = self._kernel()
        argv = self._argv(spec, st, kernel, self._initramfs_file(kernel), root,
                          Path(st["disk"]), snap=restored)
        if restored and self.restore_without_kernel:
            argv = _without(argv, ("-kernel", "-initrd", "-append"))
        return argv

    def _restore_identity(self, handle: SandboxHandle, spec: SandboxSpec) -> None:
        """The restored guest's first agent request: the agent itself gives the guest its
        hostname, a CRNG reseeded from host randomness and a fresh machine id (what it must
        not share with its template or its siblings); its answer is also the agent's first.
        A connection that gets none in time is made again and sends the request again (the
        request is idempotent, and each carries its own random bytes)."""
        attempts = 0

        def first(client: AgentClient) -> None:
            nonlocal attempts
            attempts += 1
            # the guest's agent reads one stream across host connections: what an earlier
            # connection sent may still be answered, so this one's request ids must not be
            # the ones it used
            client._next = attempts << 20
            try:
                client.identity(_safe_hostname(spec.hostname), os.urandom(16).hex(),
                                os.urandom(256))
            except AgentError as e:
                raise SandboxError(f"giving restored sandbox {handle.sandbox_id} its "
                                   f"identity failed: {e}") from e

        self._wait_ready(handle, RESTORED_RETRY, first)

    def _open_agent(self, handle: SandboxHandle, timeout: float,
                    retry: float = AGENT_RETRY,
                    first: Callable[[AgentClient], None] | None = None) -> AgentClient:
        """A client whose agent answered a ping within `timeout` (QEMU accepts one
        connection on the port's socket at a time: a second process waits its turn, and a
        guest still booting has not opened the port yet). A connection that gets no answer
        is dropped and made again every few seconds: one left behind by a killed process can
        stay unanswered while a new one is served. A shorter first ``retry`` doubles up to
        the usual one, so a slow guest is still given time to answer. Fails early if QEMU
        exits. ``first``, when given, is the first request instead of a ping."""
        deadline = time.monotonic() + timeout
        while True:
            client = self._ping_within(handle, min(retry, deadline - time.monotonic()), first)
            if client is not None:
                return client
            retry = min(retry * 2, AGENT_RETRY)
            if not self._running(handle):
                raise SandboxError("QEMU exited")
            if time.monotonic() >= deadline:
                raise SandboxError(f"the guest agent did not answer within {timeout:.0f}s "
                                   "(still booting, or another process holds its connection)")

    def _ping_within(self, handle: SandboxHandle, wait: float,
                     first: Callable[[AgentClient], None] | None = None
                     ) -> AgentClient | None:
        """One connection and one ping (or ``first``): the client if the agent answered
        within `wait`."""
        deadline = time.monotonic() + max(wait, 0.1)
        if not socket_is_ours(handle.state["agent_sock"]):
            raise SandboxError(f"the agent socket of sandbox {handle.sandbox_id} "
                               f"({handle.state['agent_sock']}) is not one this user made in "
                               "a private directory: not connecting to it")
        try:
            # the host end of the guest's virtio-serial port: only QEMU itself may serve it
            client = AgentClient.connect_unix(
                handle.state["agent_sock"], peer=lambda pid: pid == handle.state.get("pid"),
                what=f"sandbox {handle.sandbox_id}")
        except AgentError as e:
            if isinstance(e.__cause__, BlockingIOError):
                # QEMU's accept queue is full: it is busy (loading a restore's stream) and
                # has not yet taken the connections given up on before this one
                time.sleep(max(0.0, min(deadline - time.monotonic(), 0.1)))
                return None
            raise SandboxError(f"cannot reach the agent of sandbox {handle.sandbox_id}: {e}") \
                from e
        done = threading.Event()
        error: list[BaseException] = []

        def ping() -> None:
            try:
                if first is None:
                    client.ping()
                else:
                    first(client)
            except BaseException as e:  # noqa: BLE001 - reported below
                error.append(e)
            done.set()

        threading.Thread(target=ping, daemon=True).start()
        while not done.wait(0.02):
            if not self._running(handle) or time.monotonic() > deadline:
                client.close()
                done.wait(5)
                return None
        if error:
            client.close()
            if isinstance(error[0], SandboxError) and not isinstance(error[0], AgentError):
                raise error[0]
            raise SandboxError(f"the guest agent failed: {error[0]}")
        return client

    def _wait_ready(self, handle: SandboxHandle, retry: float = AGENT_RETRY,
                    first: Callable[[AgentClient], None] | None = None) -> None:
        try:
            client = self._open_agent(handle, self.boot_timeout, retry, first)
        except SandboxError as e:
            raise BackendError(f"sandbox {handle.sandbox_id} did not boot: {e.message}; "
                               f"console: {self._console_tail(handle)}") from e
        self._keep_client(handle, client)

    def _console_tail(self, handle: SandboxHandle, lines: int = 8) -> str:
        try:
            text = Path(handle.state["console"]).read_text(errors="replace")
        except (OSError, KeyError):
            return "(no console output)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no console output)"

    def destroy(self, handle: SandboxHandle) -> None:
        if not handle.sandbox_id.endswith(TEMPLATE_SUFFIX):
            # a template boot interrupted inside this sandbox's create (snapshot boot)
            work = vmsnap.build_dir(self.vm_dir, handle.sandbox_id)
            self.destroy(SandboxHandle(_template_id(handle.sandbox_id), self.name,
                                       {"state_dir": str(work / "vm")}))
            shutil.rmtree(work, ignore_errors=True)
        st = {**_default_state(handle.sandbox_id, handle.state.get("state_dir")), **handle.state}
        self._drop_client(handle.sandbox_id)
        pid = st.get("pid")
        if pid is None:  # QEMU may have started before the handle was saved
            pid = _read_pidfile(st) or _find_qemu(handle.sandbox_id)
        elif vmpark.saved(handle) and not self._is_our_qemu(handle, pid):
            pid = _find_qemu(handle.sandbox_id)  # a thaw killed before its row was written
        if pid and self._is_our_qemu(handle, pid):
            quit_qemu(st["qmp"], pid, 3.0)
        # a create killed while QEMU daemonized: the pid found may have been the parent,
        # which exits once its daemon child (same -name, no pid recorded) runs, so whatever
        # still carries this sandbox's name is ended as well
        for _ in range(3):
            left = _find_qemu(handle.sandbox_id)
            if left is None or not self._is_our_qemu(handle, left):
                break
            quit_qemu(st["qmp"], left, 1.0)
        mnt = st.get("snap_mount")
        if mnt and os.path.ismount(mnt):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        if st.get("cgroup"):
            _cgroups.Cgroup(st["cgroup"]).remove()
        remove_run_dir(st["run_dir"])
        if st.get("disk"):
            Path(st["disk"]).unlink(missing_ok=True)
        if st.get("state_dir"):
            vmpark.remove_files(Path(st["state_dir"]))
        if st.get("network") == "allowlist" or egress.attached(handle.sandbox_id):
            egress.detach(handle.sandbox_id)  # also after a create killed midway

    def _is_our_qemu(self, handle: SandboxHandle, pid: int) -> bool:
        """True if `pid` is still this sandbox's QEMU (not a reused pid)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        argv0 = b"\0" + cmdline
        return (b"\0" + _qemu_name(handle.sandbox_id) + b"\0" in argv0
                and _proc_start(pid) is not None)

    def is_alive(self, handle: SandboxHandle) -> bool:
        """QEMU runs the guest, or the guest is parked to a complete state file (vmpark)."""
        pid = handle.state.get("pid")
        return (isinstance(pid, int) and self._is_our_qemu(handle, pid)) or \
            vmpark.saved(handle)

    def is_paused(self, handle: SandboxHandle) -> bool:
        try:
            status = qmp(handle.state["qmp"], "query-status", timeout=5)
        except QMPError:
            return False
        return bool(status) and not status.get("running", True)

    # -- park to a file (vmpark.py) ------------------------------------------------------------
    def park(self, handle: SandboxHandle) -> dict[str, Any]:
        """Save the running guest to a state file beside its disk; QEMU exits."""
        return vmpark.park(self, handle)

    def thaw(self, handle: SandboxHandle, commit: Any, cpu_class: str | None = None
             ) -> dict[str, Any]:
        """A parked guest running again from its state file; the new handle state."""
        return vmpark.thaw(self, handle, commit, cpu_class)

    def moved_state(self, old: dict[str, Any], sid: str, sdir: Path, root: Path,
                    cgroup: str, limits: Limits) -> dict[str, Any]:
        """The handle state of a parked guest moved here from another node."""
        return vmpark.moved_state(self, old, sid, sdir, root, cgroup, limits)

    def pause(self, handle: SandboxHandle) -> None:
        self._require_alive(handle)
        qmp(handle.state["qmp"], "stop")

    def resume(self, handle: SandboxHandle) -> None:
        self._require_alive(handle)
        qmp(handle.state["qmp"], "cont")

    def snapshot_diff(self, handle: SandboxHandle) -> Path:
        """Flush the guest's writes, stop it, copy ``upper/`` off its disk, let it run on."""
        if vmpark.saved(handle) and not self._running(handle):
            # writes the guest had not flushed are in its saved RAM, not on its disk yet
            raise UsageError(f"sandbox {handle.sandbox_id} is parked to a state file",
                             hint=f"dsec thaw {handle.sandbox_id}, then snapshot it")
        self._require_alive(handle)
        was_paused = self.is_paused(handle)
        if was_paused:
            qmp(handle.state["qmp"], "cont")
        res = self.client(handle).exec(["sync"], timeout=120)
        if res.exit_code != 0:
            raise SandboxError(f"sync in sandbox {handle.sandbox_id} failed: "
                               f"{res.stderr.decode(errors='replace').strip()}")
        qmp(handle.state["qmp"], "stop")
        try:
            sdir = Path(handle.state["state_dir"])
            dest = sdir / f"diff-{time.time_ns()}"
            vmimage.read_upper(Path(handle.state["disk"]), dest, Path(handle.state["snap_mount"]))
        finally:
            if not was_paused:
                qmp(handle.state["qmp"], "cont")
        return dest

    def describe(self, handle: SandboxHandle) -> dict[str, Any]:
        st = handle.state
        return {"pid": st.get("pid"), "machine": self.machine.split(",")[0],
                "accel": st.get("accel"), "network": st.get("network"),
                "root_image": st.get("root_image"), "console": st.get("console"),
                "paused": self.is_paused(handle) if self._running(handle) else False,
                "parked_to": str(vmpark.state_file(handle)) if vmpark.saved(handle) else None,
                **egress.describe(st)}

    def _running(self, handle: SandboxHandle) -> bool:
        pid = handle.state.get("pid")
        return isinstance(pid, int) and self._is_our_qemu(handle, pid)

    def _require_alive(self, handle: SandboxHandle) -> None:
        if not self._running(handle):
            raise SandboxError(f"sandbox {handle.sandbox_id} is not running (its QEMU is gone)",
                               hint=f"see its console log: {handle.state.get('console')}")

    # -- work inside ---------------------------------------------------------------------------
    def _connect(self, handle: SandboxHandle) -> AgentClient:
        self._require_alive(handle)
        return self._open_agent(handle, CONNECT_TIMEOUT)

    def exec(self, handle: SandboxHandle, request: ExecRequest,
             on_output: OutputCallback | None = None) -> ExecResult:
        env = {**handle.state.get("env", {}), **request.env}
        cwd = request.cwd or handle.state.get("workdir") or "/"
        return self.client(handle).exec(request.argv, env, cwd, request.stdin, request.timeout,
                                        on_output, request.capture_limit, request.user)



class MicroVMBackend(QemuBackend):
    """QEMU `-M microvm`: virtio-mmio devices described by ACPI, qboot firmware."""

    name: ClassVar[str] = "microvm"
    # no option ROMs to run; the RTC stays: without it the guest kernel spends ~2 s under
    # TCG failing to read the time
    machine: ClassVar[str] = "microvm,x-option-roms=off"
    blk_dev: ClassVar[str] = "virtio-blk-device"
    serial_dev: ClassVar[str] = "virtio-serial-device"
    balloon_dev: ClassVar[str] = "virtio-balloon-device"
    net_dev: ClassVar[str] = "virtio-net-device"


class VMBackend(QemuBackend):
    """QEMU q35: a full PC (SeaBIOS, PCIe, ACPI) with virtio-pci devices."""

    name: ClassVar[str] = "vm"
    machine: ClassVar[str] = "q35"
    blk_dev: ClassVar[str] = "virtio-blk-pci"
    serial_dev: ClassVar[str] = "virtio-serial-pci"
    balloon_dev: ClassVar[str] = "virtio-balloon-pci"
    net_dev: ClassVar[str] = "virtio-net-pci"


def guest_shape(limits: Limits, hostname: str = "sandbox") -> dict[str, Any]:
    """What of a guest's spec its QEMU command line holds besides paths (its CPUs, memory,
    pids limit, hostname), kept in its handle state so a parked guest's command line is
    built again (`QemuBackend.parked_argv`)."""
    return {"cpus": limits.cpus, "memory": limits.memory, "pids": limits.pids,
            "hostname": _safe_hostname(hostname)}


def _default_state(sid: str, state_dir: str | None) -> dict[str, Any]:
    """Where a sandbox's files are, derived from its id and state dir alone: what destroy
    needs when a crash left no saved handle. The run dir (QMP and agent sockets, pidfile)
    is ``<runtime dir>/vm/<id>`` (core/rundir.py): private to this user, short enough for
    unix socket paths, and the same for the id whatever process asks."""
    run = runtime_dir("vm") / sid
    st: dict[str, Any] = {"run_dir": str(run), "pidfile": str(run / "qemu.pid"),
                          "qmp": str(run / "qmp.sock"), "agent_sock": str(run / "agent.sock")}
    if state_dir:
        sdir = Path(state_dir)
        st.update(state_dir=str(sdir), console=str(sdir / "console.log"),
                  disk=str(sdir / "disk.ext4"), snap_mount=str(sdir / "snap-mnt"))
    return st


def make_run_dir(st: dict[str, Any]) -> Path:
    """The sandbox's run dir, created private (0700, ours): one that is already there and
    another user made or may enter is refused, never used (its sockets may be theirs, and
    QEMU writes its pidfile as root)."""
    for key in ("qmp", "agent_sock"):
        if len(os.fsencode(st[key])) > SOCKET_PATH_MAX:
            raise ConfigError(f"the socket path {st[key]} is longer than {SOCKET_PATH_MAX} "
                              "bytes, the most a unix socket takes",
                              hint="set DSEC_RUNTIME_DIR to a shorter directory")
    return private_dir(st["run_dir"])


def _read_pidfile(st: dict[str, Any]) -> int | None:
    """The pid QEMU wrote, read only from a run dir of ours."""
    try:
        check_private(st["run_dir"])
        fd = open_beneath(st["run_dir"], os.path.basename(st["pidfile"]),
                          os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ConfigError):
        return None
    with os.fdopen(fd) as f:
        try:
            return int(f.read(32).strip())
        except (OSError, ValueError):
            return None


def remove_run_dir(run_dir: str) -> None:
    """Remove a run dir that is ours; one another user made is left to them."""
    try:
        check_private(run_dir)
    except ConfigError:
        return
    shutil.rmtree(run_dir, ignore_errors=True)


TEMPLATE_SUFFIX = "-tpl"


def _template_id(sid: str) -> str:
    return sid + TEMPLATE_SUFFIX


def _qemu_name(sid: str) -> bytes:
    return f"dsec-{sid},process=dsec-{sid}".encode()


def _find_qemu(sid: str) -> int | None:
    """The pid of this sandbox's QEMU found by its -name, when no pid was recorded."""
    name = _qemu_name(sid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"\0" + name + b"\0" in b"\0" + (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


def _ksm_on() -> bool:
    """Whether the host's same-page merging runs now (`dsec node setup --ksm`)."""
    try:
        return Path("/sys/kernel/mm/ksm/run").read_text().strip() == "1"
    except OSError:
        return False
def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less the given options and their values."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a in options:
            next(it, None)
        else:
            out.append(a)
    return out


def _safe_hostname(name: str) -> str:
    cleaned = "".join(ch for ch in name if ch.isalnum() or ch in "-.")[:63]
    return cleaned or "sandbox"


def quit_qemu(qmp_path: str, pid: int, grace: float) -> None:
    """End a QEMU: asked to quit over QMP, killed if it has not gone within ``grace``."""
    try:
        qmp(qmp_path, "quit", timeout=2)
    except QMPError:
        pass
    if not _wait_gone(pid, grace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_gone(pid, 10.0)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _proc_start(pid) is None:
            return True
        time.sleep(0.05)
    return _proc_start(pid) is None


__all__ = ["MicroVMBackend", "VMBackend", "QemuBackend"]
