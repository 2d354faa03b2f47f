"""The `container` backend: runc over an overlay rootfs, with dsec-agent as the container's init.

Create = mount the overlay (image layers + skeleton + the sandbox's upper dir), write an OCI
runtime spec (namespaces, cgroup limits, capabilities, masked paths), `runc run --detach`.
runc exits once the container runs; the container outlives it and any dsec process (the
init is re-parented to the host's init), and dsec finds it again through the handle's state.
Exec, put and get go to the agent over a unix socket bind-mounted into the container, so a
warm exec is a fork inside the sandbox. Pause and resume use the cgroup freezer; destroy
kills the container's init (the kernel then kills its whole pid namespace), removes its
cgroups, runc's state and the mount.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import BackendError
from . import _cgroups, _rootfs, seccomp
from .agented import AGENT_SOCKET_FD, CgroupAgentBackend, bind_agent_socket
from .base import (
    BackendContext,
    SandboxHandle,
    SandboxSpec,
)
from .sandbox_agent import agent_binary

log = logging.getLogger(__name__)

# Docker's default capability set: enough for package managers and build tools, without
# SYS_ADMIN, NET_ADMIN, SYS_MODULE, SYS_PTRACE and the like.
CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
        "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
MASKED = list(_rootfs.MASKED_PATHS)  # runc masks each that exists
# /sys/fs/cgroup: runc puts the cgroup v1 hierarchies on a writable tmpfs there
READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
            "/sys/fs/cgroup"]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def runc_binary() -> str:
    path = shutil.which("runc") or ("/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else None)
    if path is None:
        raise BackendError("runc is not installed", hint="run scripts/setup.sh (apt: runc)")
    return path


def oci_spec(spec: SandboxSpec, rootfs: Path, agent: Path, cgroup: str
             ) -> dict[str, Any]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", **spec.env}
    lim = spec.limits
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if lim.memory:
        resources["memory"] = {"limit": lim.memory, "swap": lim.memory}
    if lim.pids:
        resources["pids"] = {"limit": lim.pids}
    if lim.cpus:
        resources["cpu"] = {"quota": max(1000, int(lim.cpus * 100000)), "period": 100000}
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup")]
    if spec.network in ("none", "allowlist"):
        namespaces.append({"type": "network"})
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        # a fresh read-only sysfs in every network mode: a bind of the host's /sys brings its
        # submounts (cgroupfs among them) read-write, as runc's "ro" is not recursive. Root
        # in the host's user namespace may mount sysfs even without a network namespace.
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        # the sandbox's own cgroups, read-only (tools read their limits there)
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
        {"destination": _rootfs.AGENT_IN_SANDBOX, "type": "bind", "source": str(agent),
         "options": ["bind", "ro"]},
    ]
    if spec.network == "host" and os.path.exists("/etc/resolv.conf"):
        mounts.append({"destination": "/etc/resolv.conf", "type": "bind",
                       "source": "/etc/resolv.conf", "options": ["bind", "ro"]})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [_rootfs.AGENT_IN_SANDBOX, "--listen-fd", str(AGENT_SOCKET_FD),
                     "--ready-fd", "3"],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": spec.workdir or "/",
            "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": {
            "cgroupsPath": "/" + cgroup,
            "resources": resources,
            "namespaces": namespaces,
            "maskedPaths": MASKED,
            "readonlyPaths": READONLY,
            "seccomp": seccomp.oci_profile(),
        },
    }


class ContainerBackend(CgroupAgentBackend):
    name: ClassVar[str] = "container"

    supports_snapshot = True  # the overlay's upper dir is the diff
    upper_on_host = True

    @classmethod
    def from_context(cls, ctx: BackendContext) -> ContainerBackend:
        return cls(ctx.cgroup_parent, None if ctx.runtime_root is None else str(ctx.runtime_root),
                   str(ctx.state_dir))

    def __init__(self, cgroup_parent: str = "dsec", runc_root: str | None = None,
                 shared_dir: str | None = None) -> None:
        self.cgroup_parent = cgroup_parent
        self.runc_root = runc_root
        self.shared_dir = shared_dir  # node-wide files (the skeleton layer); else per sandbox
        super().__init__()

    # -- lifecycle -----------------------------------------------------------------------------
    def create(self, spec: SandboxSpec) -> SandboxHandle:
        sdir = spec.state_dir
        runc_root = self.runc_root or str(sdir.parent / ".runc")
        cgroup = f"{self.cgroup_parent}/{spec.sandbox_id}"
        rootfs, skel = sdir / "rootfs", sdir / "skel"
        upper, work = spec.rootfs.upper_dir, spec.rootfs.work_dir
        disk = sdir / "disk"
        if spec.limits.disk:  # upper and work on the sandbox's own bounded filesystem
            upper, work = disk / "upper", disk / "work"
        handle = SandboxHandle(spec.sandbox_id, self.name, {
            "rootfs": str(rootfs), "cgroup": cgroup,
            "runc_root": runc_root, "upper": str(upper),
            "state_dir": str(sdir), "network": spec.network,
            "limited": bool(spec.limits.memory or spec.limits.pids),
            "agent_sock": str(sdir / "agent.sock"),  # host-private: see agented.py
        })
        if spec.limits.disk:
            handle.state["disk"] = str(disk)
        try:
            if spec.limits.disk:
                _rootfs.make_disk(sdir / "disk.img", disk, spec.limits.disk,
                                  Path(self.shared_dir) / "disks" if self.shared_dir else None)
            for d in (upper, work):
                d.mkdir(parents=True, exist_ok=True)
            if self.shared_dir:
                skel = _rootfs.shared_skeleton(Path(self.shared_dir))
            else:
                _rootfs.make_skeleton(skel)
            _rootfs.mount_overlay(rootfs, [*spec.rootfs.lower_dirs, skel], upper, work)
            config = oci_spec(spec, rootfs, agent_binary(), cgroup)
            (sdir / "config.json").write_text(json.dumps(config))
            pid = self._runc_run(spec.sandbox_id, sdir, runc_root)
            handle.state["pid"] = pid
            if spec.limits.cpu_class:
                _cgroups.Cgroup(cgroup).apply_class(spec.limits.cpu_class)
            handle.state["start_time"] = _rootfs.proc_start_time(pid)
            if spec.network in ("none", "allowlist"):
                _rootfs.loopback_up(pid)
            if spec.network == "allowlist":
                from . import egress

                handle.state["egress"] = egress.attach(spec.sandbox_id, pid, list(spec.egress),
                                                       sdir)
                self.pin_names(handle)
        except BaseException:
            self.destroy(handle)
            raise
        return handle

    def _runc_run(self, sid: str, sdir: Path, runc_root: str) -> int:
        r, w = os.pipe()
        sock = bind_agent_socket(sdir / "agent.sock")
        log_path = sdir / "runc.log"
        argv = [runc_binary(), "--root", runc_root, "run", "--detach", "--preserve-fds", "2",
                "--bundle", str(sdir), "--pid-file", str(sdir / "pid"), sid]
        try:
            with open(log_path, "wb") as logf, open(os.devnull, "rb") as null:
                # posix_spawn places the ready pipe at fd 3 without running Python code
                # between fork and exec (safe with many creating threads)
                pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=[
                    (os.POSIX_SPAWN_DUP2, null.fileno(), 0),
                    (os.POSIX_SPAWN_DUP2, logf.fileno(), 1),
                    (os.POSIX_SPAWN_DUP2, logf.fileno(), 2),
                    (os.POSIX_SPAWN_DUP2, w, 3),
                    (os.POSIX_SPAWN_DUP2, sock.fileno(), AGENT_SOCKET_FD),
                ])
        finally:
            os.close(w)
            sock.close()
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            os.close(r)
            msg = log_path.read_text(errors="replace").strip()
            raise BackendError(f"runc could not start sandbox {sid}: {_runc_message(msg)}")
        _rootfs.wait_ready(r, 30, f"sandbox {sid}")
        return int((sdir / "pid").read_text().strip())

    def destroy(self, handle: SandboxHandle) -> None:
        st = handle.state
        self._drop_client(handle.sandbox_id)
        cg = _cgroups.Cgroup(st.get("cgroup") or f"{self.cgroup_parent}/{handle.sandbox_id}")
        pid = st.get("pid")
        if pid and _rootfs.alive(pid, st.get("start_time")):
            _kill_init(pid, cg)
        try:
            cg.remove()
        except BackendError:
            log.warning("falling back to runc delete for %s", handle.sandbox_id)
            self._runc(st, "delete", "--force", handle.sandbox_id, check=False)
            cg.remove()
        from . import egress

        if st.get("network") == "allowlist" or egress.attached(handle.sandbox_id):
            egress.detach(handle.sandbox_id)  # also after a create killed midway
        runc_root = st.get("runc_root")
        if runc_root:
            shutil.rmtree(Path(runc_root) / handle.sandbox_id, ignore_errors=True)
        if st.get("rootfs"):
            _rootfs.umount(Path(st["rootfs"]))
        disk = st.get("disk") or (st.get("state_dir") and str(Path(st["state_dir"]) / "disk"))
        if disk and _rootfs.mounts_at(Path(disk)):
            _rootfs.umount(Path(disk))  # the loop device goes with it (autoclear)
            Path(disk).with_suffix(".img").unlink(missing_ok=True)

    def snapshot_diff(self, handle: SandboxHandle) -> Path:
        return Path(handle.state["upper"])

    def describe(self, handle: SandboxHandle) -> dict[str, Any]:
        cg = _cgroups.Cgroup(handle.state["cgroup"])
        out = {"pid": handle.state.get("pid"), "cgroup": handle.state["cgroup"],
               "runtime": "runc", "network": handle.state.get("network"),
               "paused": cg.frozen(), **cg.counters()}
        from . import egress

        return {**out, **egress.describe(handle.state)}

    def _runc(self, st: dict[str, Any], *args: str, check: bool = True) -> str:
        argv = [runc_binary(), "--root", st["runc_root"], *args]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise BackendError(f"runc {args[0]} failed: {_runc_message(proc.stderr)}")
        return proc.stdout


def _kill_init(pid: int, cg: _cgroups.Cgroup) -> None:
    """SIGKILL a sandbox's init and wait for it: the kernel kills the rest of its pid
    namespace and reaps it before the init is gone, so the cgroup is empty afterwards."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # already gone
    try:
        if cg.frozen():
            cg.kill_all()  # queues SIGKILL, then thaws
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return
        _rootfs.readable(pidfd, 10)  # a pidfd is readable once the process is gone
    finally:
        os.close(pidfd)
def _runc_message(text: str) -> str:
    """The useful part of runc's logfmt error lines."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "no error output"
    last = lines[-1]
    if 'msg="' in last:
        last = last.split('msg="', 1)[1].rsplit('"', 1)[0]
    return last
