"""The `fncall` backend: light bubblewrap sandboxes for short calls.

Two faces:

* `FncallBackend` (the Backend interface, what `dsec run --backend fncall` uses): a
  read-only view of the image (an overlay of its layers with no upper dir; /tmp is a private
  tmpfs), new user/pid/net/ipc/uts namespaces (no network unless asked), every capability
  dropped, a cgroup for memory, pids and CPU, and dsec-agent as the init, so exec, put and get
  work as in a container. It cannot be snapshotted: nothing outside /tmp is writable.
* `FunctionPool` (fnpool.py): a warm pool of pre-started bwrap workers over a read-only view
  of the host's Python, running a command or a pickled Python callable per call in a fresh
  fork, so a call costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import BackendError, UsageError
from . import _cgroups, _rootfs, seccomp
from .agented import AGENT_SOCKET_FD, CgroupAgentBackend, bind_agent_socket
from .base import (
    BackendContext,
    ExecRequest,
    ExecResult,
    OutputCallback,
    SandboxHandle,
    SandboxSpec,
    UserIds,
)
from .container import DEFAULT_PATH
from .sandbox_agent import agent_binary

SECCOMP_FD = 5  # bwrap reads the seccomp program here; fd 4 carries the agent's socket


def bwrap_binary() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise BackendError("bubblewrap is not installed",
                           hint="run scripts/setup.sh (apt: bubblewrap)")
    return path


def descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _in_netns(bwrap_pid: int) -> int:
    """A process of the sandbox's own network namespace (bwrap itself stays in the host's):
    where the egress link goes."""
    host = os.readlink(f"/proc/{bwrap_pid}/ns/net")
    for p in descendants(bwrap_pid):
        try:
            if os.readlink(f"/proc/{p}/ns/net") != host:
                return p
        except OSError:
            continue
    raise BackendError(f"bwrap {bwrap_pid} made no network namespace")


class FncallBackend(CgroupAgentBackend):
    name: ClassVar[str] = "fncall"

    supports_snapshot = False  # read-only: only /tmp is writable, in memory
    fork_mode = "tmp"  # its /tmp is all a copy can differ in
    member_estimate = 8 << 20

    @classmethod
    def from_context(cls, ctx: BackendContext) -> FncallBackend:
        return cls(ctx.cgroup_parent, str(ctx.state_dir))

    def __init__(self, cgroup_parent: str = "dsec", shared_dir: str | None = None) -> None:
        self.cgroup_parent = cgroup_parent
        self.shared_dir = shared_dir  # node-wide files (the skeleton layer); else per sandbox
        super().__init__()

    def create(self, spec: SandboxSpec) -> SandboxHandle:
        sdir = spec.state_dir
        rootfs, skel = sdir / "rootfs", sdir / "skel"
        cgroup = f"{self.cgroup_parent}/{spec.sandbox_id}"
        handle = SandboxHandle(spec.sandbox_id, self.name, {
            "rootfs": str(rootfs), "cgroup": cgroup,
            "state_dir": str(sdir), "network": spec.network,
            "limited": bool(spec.limits.memory or spec.limits.pids),
            "agent_sock": str(sdir / "agent.sock")})  # host-private: see agented.py
        try:
            if self.shared_dir:
                skel = _rootfs.shared_skeleton(Path(self.shared_dir))
            else:
                _rootfs.make_skeleton(skel)
            _rootfs.mount_overlay(rootfs, [*spec.rootfs.lower_dirs, skel])  # read-only
            cg = _cgroups.Cgroup(cgroup)
            lim = spec.limits
            cg.create(memory=lim.memory, pids=lim.pids, cpus=lim.cpus)
            pid = self._spawn(spec, rootfs, cg)
            handle.state["pid"] = pid
            handle.state["start_time"] = _rootfs.proc_start_time(pid)
            for p in descendants(pid):  # bwrap, its pid-1 and the agent: children inherit
                cg.add(p)
            if lim.cpu_class:
                cg.apply_class(lim.cpu_class)
            if spec.network == "allowlist":
                from . import egress

                handle.state["egress"] = egress.attach(spec.sandbox_id, _in_netns(pid),
                                                       list(spec.egress), sdir)
        except BaseException:
            self.destroy(handle)
            raise
        return handle

    def agent_user(self, handle: SandboxHandle, user: UserIds | None) -> UserIds | None:
        """The agent runs as the sandbox's user (its user namespace maps that one id, with
        no capability): a request as that user needs no ids, one as another is refused."""
        if user is None:
            return None
        doc = handle.state.get("user")
        own = UserIds.from_json(doc) if doc else UserIds(0, 0)
        if (user.uid, user.gid) != (own.uid, own.gid):
            raise UsageError(f"fncall sandboxes run every command and file access as the user "
                             f"they were created with ({own.uid}:{own.gid}), not "
                             f"{user.uid}:{user.gid}",
                             hint="create the sandbox with --user, or use the container "
                                  "backend")
        return None

    def exec(self, handle: SandboxHandle, request: ExecRequest,
             on_output: OutputCallback | None = None) -> ExecResult:
        """Every command runs as the sandbox's user: asking for another is refused."""
        if request.user is not None:
            request = dataclasses.replace(request, user=self.agent_user(handle, request.user))
        return super().exec(handle, request, on_output)

    def _spawn(self, spec: SandboxSpec, rootfs: Path, cg: _cgroups.Cgroup) -> int:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", **spec.env}
        # bwrap reads the seccomp program from SECCOMP_FD; /tmp is the only writable place,
        # sized by --disk
        tmp_size = ["--size", str(spec.limits.disk)] if spec.limits.disk else []
        argv = [bwrap_binary(), "--bind", str(rootfs), "/", "--proc", "/proc",
                *_rootfs.bwrap_walls(SECCOMP_FD), "--dev", "/dev",
                *tmp_size, "--tmpfs", "/tmp",
                "--ro-bind", str(agent_binary()), _rootfs.AGENT_IN_SANDBOX,
                "--unshare-all", "--hostname", spec.hostname, "--new-session",
                "--cap-drop", "ALL", "--clearenv"]
        if spec.network == "host":
            argv.append("--share-net")
        if spec.user is not None and (spec.user.uid, spec.user.gid) != (0, 0):
            # one id each is mapped: every command runs as this user (no other can be taken)
            argv += ["--unshare-user", "--uid", str(spec.user.uid), "--gid", str(spec.user.gid)]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--chdir", spec.workdir or "/", "--", _rootfs.AGENT_IN_SANDBOX, "--listen-fd",
                 str(AGENT_SOCKET_FD), "--ready-fd", "3"]
        r, w = os.pipe()
        filt = seccomp.bpf_fd()
        sock = bind_agent_socket(spec.state_dir / "agent.sock")
        log_path = spec.state_dir / "bwrap.log"
        try:
            with open(log_path, "wb") as logf, open(os.devnull, "rb") as null:
                pid = os.posix_spawn(argv[0], argv, os.environ, setsid=True, file_actions=[
                    (os.POSIX_SPAWN_DUP2, null.fileno(), 0),
                    (os.POSIX_SPAWN_DUP2, logf.fileno(), 1),
                    (os.POSIX_SPAWN_DUP2, logf.fileno(), 2),
                    (os.POSIX_SPAWN_DUP2, w, 3),
                    (os.POSIX_SPAWN_DUP2, sock.fileno(), AGENT_SOCKET_FD),
                    (os.POSIX_SPAWN_DUP2, filt, SECCOMP_FD),
                ])
        finally:
            os.close(w)
            os.close(filt)
            sock.close()
        try:
            # join the cgroup at once, so a crash from here on leaves nothing outside it
            # (what bwrap forked before this is added again once it is ready)
            cg.add(pid)
            _rootfs.wait_ready(r, 30, f"sandbox {spec.sandbox_id}")
        except BackendError as e:
            msg = log_path.read_text(errors="replace").strip()
            raise BackendError(f"{e.message}: {msg or 'bwrap gave no reason'}") from e
        return pid

    def destroy(self, handle: SandboxHandle) -> None:
        st = handle.state
        self._drop_client(handle.sandbox_id)
        pid = st.get("pid")
        if pid and _rootfs.alive(pid, st.get("start_time")):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _cgroups.Cgroup(st.get("cgroup") or f"{self.cgroup_parent}/{handle.sandbox_id}").remove()
        if pid:
            try:  # started by this process: reap it (a detached one is reaped by init)
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        from . import egress

        if st.get("network") == "allowlist" or egress.attached(handle.sandbox_id):
            egress.detach(handle.sandbox_id)  # also after a create killed midway
        if st.get("rootfs"):
            _rootfs.umount(Path(st["rootfs"]))

    def snapshot_diff(self, handle: SandboxHandle) -> Path:
        raise UsageError("fncall sandboxes are read-only (only /tmp is writable, in memory): "
                         "use the container backend to snapshot")

    def describe(self, handle: SandboxHandle) -> dict[str, Any]:
        from . import egress

        cg = _cgroups.Cgroup(handle.state["cgroup"])
        return {"pid": handle.state.get("pid"), "runtime": "bwrap", "paused": cg.frozen(),
                "network": handle.state.get("network"), **cg.counters(),
                **egress.describe(handle.state)}
