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
otherwise. The command line is built in `qemuargv`, the QEMU process and its run dir are
`qemuproc`'s, the agent channel `qemuagent`'s; park to a file is `vmpark`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ...core.config import load_config
from ...core.errors import BackendError, SandboxError, UsageError
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
from ..sandbox_agent.client import AgentClient
from . import qemu_accel, vmimage, vmpark, vmsnap
from .qemu_qmp import QMPError, qmp
from .qemuagent import (
    AGENT_RETRY,
    RESTORED_RETRY,
    console_tail,
    identity_request,
    open_agent,
    ping_within,
)
from .qemuargv import DEFAULT_MEMORY, check_spec, guest_shape, qemu_argv, without
from .qemuproc import (
    TEMPLATE_SUFFIX,
    default_state,
    find_qemu,
    make_run_dir,
    proc_start,
    qemu_name,
    quit_qemu,
    read_pidfile,
    remove_run_dir,
    template_id,
    wait_gone,
)
from .vmkernel import Kernel, boot_image, build_initramfs, find_kernel

log = logging.getLogger(__name__)

BOOT_TIMEOUT = 180.0  # TCG on a loaded 2-core host boots in tens of seconds
CONNECT_TIMEOUT = 60.0  # waiting for another process to release the agent connection



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

    def _argv(self, spec: SandboxSpec, st: dict[str, Any], kernel: Kernel, initramfs: Path,
              root: Path, disk: Path, snap: bool = False) -> list[str]:
        return qemu_argv(self, self._qemu_binary(), spec, st,
                         boot_image(kernel, self.vm_dir / "kernel"), initramfs, root, disk, snap)

    # -- lifecycle -----------------------------------------------------------------------------
    def create(self, spec: SandboxSpec) -> SandboxHandle:
        check_spec(spec)
        self._qemu_binary()
        self._kernel()  # a missing kernel is bad input: refused before anything is made
        if self.boot == "snapshot":
            try:
                return self._create_restored(spec)
            except (BackendError, SandboxError, OSError) as e:  # cold boot: the fallback
                log.warning("sandbox %s: snapshot boot failed (%s); booting cold",
                            spec.sandbox_id, e)
        return self._create_cold(spec)

    def _state(self, spec: SandboxSpec) -> dict[str, Any]:
        return {**default_state(spec.sandbox_id, str(spec.state_dir)), "machine": self.name,
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
        st["pid"], st["start_time"] = pid, proc_start(pid)
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
            tspec = dataclasses.replace(spec, sandbox_id=template_id(spec.sandbox_id),
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
                wait_gone(h.state["pid"], 30.0)
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
            argv = without(argv, ("-kernel", "-initrd", "-append"))
        return argv

    def _restore_identity(self, handle: SandboxHandle, spec: SandboxSpec) -> None:
        self._wait_ready(handle, RESTORED_RETRY, identity_request(handle, spec.hostname))

    def _open_agent(self, handle: SandboxHandle, timeout: float, retry: float = AGENT_RETRY,
                    first: Callable[[AgentClient], None] | None = None) -> AgentClient:
        # each connection through the method, which benchmarks/bench_pools.py times
        return open_agent(timeout, lambda wait, req: self._ping_within(handle, wait, req),
                          lambda: self._running(handle), retry, first)

    def _ping_within(self, handle: SandboxHandle, wait: float,
                     first: Callable[[AgentClient], None] | None = None
                     ) -> AgentClient | None:
        return ping_within(handle, wait, lambda: self._running(handle), first)

    def _wait_ready(self, handle: SandboxHandle, retry: float = AGENT_RETRY,
                    first: Callable[[AgentClient], None] | None = None) -> None:
        try:
            client = self._open_agent(handle, self.boot_timeout, retry, first)
        except SandboxError as e:
            raise BackendError(f"sandbox {handle.sandbox_id} did not boot: {e.message}; "
                               f"console: {console_tail(handle)}") from e
        self._keep_client(handle, client)

    def destroy(self, handle: SandboxHandle) -> None:
        if not handle.sandbox_id.endswith(TEMPLATE_SUFFIX):
            # a template boot interrupted inside this sandbox's create (snapshot boot)
            work = vmsnap.build_dir(self.vm_dir, handle.sandbox_id)
            self.destroy(SandboxHandle(template_id(handle.sandbox_id), self.name,
                                       {"state_dir": str(work / "vm")}))
            shutil.rmtree(work, ignore_errors=True)
        st = {**default_state(handle.sandbox_id, handle.state.get("state_dir")), **handle.state}
        self._drop_client(handle.sandbox_id)
        pid = st.get("pid")
        if pid is None:  # QEMU may have started before the handle was saved
            pid = read_pidfile(st) or find_qemu(handle.sandbox_id)
        elif vmpark.saved(handle) and not self._is_our_qemu(handle, pid):
            pid = find_qemu(handle.sandbox_id)  # a thaw killed before its row was written
        if pid and self._is_our_qemu(handle, pid):
            quit_qemu(st["qmp"], pid, 3.0)
        # a create killed while QEMU daemonized: the pid found may have been the parent,
        # which exits once its daemon child (same -name, no pid recorded) runs, so whatever
        # still carries this sandbox's name is ended as well
        for _ in range(3):
            left = find_qemu(handle.sandbox_id)
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
        return (b"\0" + qemu_name(handle.sandbox_id) + b"\0" in argv0
                and proc_start(pid) is not None)

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


__all__ = ["MicroVMBackend", "VMBackend", "QemuBackend"]
