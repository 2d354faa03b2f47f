"""Backends whose sandboxes run dsec-agent as their init: one cached agent connection per
sandbox (so a warm exec is one round trip), and exec and file transfer through it.

`AgentBackend` needs only `_connect`; `CgroupAgentBackend` adds what sandboxes whose
processes share one cgroup have in common (freezer pause, limit accounting on exec), and
the one way their agents are reached: a unix socket that the host binds in the sandbox's
private state directory (which no sandbox can see) and hands to the agent as an open fd,
whose listener must be a process of the sandbox's own cgroup (SO_PEERCRED)."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import fcntl
import socket
import threading
import time
from pathlib import Path
from typing import BinaryIO

from ..core.files import unix_address
from . import _cgroups, _rootfs
from .base import (
    Backend,
    ExecRequest,
    ExecResult,
    OutputCallback,
    SandboxHandle,
    TreeSink,
    UserIds,
)
from .sandbox_agent.aio import AsyncAgentClient, AsyncOutputCallback
from .sandbox_agent.client import AgentClient, PeerCheck

#: the fd number at which a sandbox's agent receives its bound socket (`--listen-fd`)
AGENT_SOCKET_FD = 4


class AgentBackend(Backend):
    def __init__(self) -> None:
        self._clients: dict[str, AgentClient] = {}
        self._lock = threading.Lock()

    @abc.abstractmethod
    def _connect(self, handle: SandboxHandle) -> AgentClient:
        """A new connection to the sandbox's agent."""

    def client(self, handle: SandboxHandle) -> AgentClient:
        with self._lock:
            c = self._clients.get(handle.sandbox_id)
            if c is not None and c.closed is None:
                return c
        c = self._connect(handle)
        with self._lock:
            old = self._clients.get(handle.sandbox_id)
            if old is not None and old.closed is None:  # another thread connected first
                c.close()
                return old
            self._clients[handle.sandbox_id] = c
        return c

    def _keep_client(self, handle: SandboxHandle, client: AgentClient) -> None:
        with self._lock:
            self._clients[handle.sandbox_id] = client

    def _drop_client(self, sid: str) -> None:
        with self._lock:
            c = self._clients.pop(sid, None)
        if c is not None:
            c.close()

    def drop_connections(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            c.close()

    def exec(self, handle: SandboxHandle, request: ExecRequest,
             on_output: OutputCallback | None = None) -> ExecResult:
        return self.client(handle).exec(request.argv, request.env, request.cwd, request.stdin,
                                        request.timeout, on_output, request.capture_limit,
                                        request.user)

    def agent_user(self, handle: SandboxHandle, user: UserIds | None) -> UserIds | None:
        """The ids a request carries to act as `user`; a backend whose agent cannot take
        another user's ids refuses here (or drops ids that are the agent's own)."""
        return user

    def put_file(self, handle: SandboxHandle, path: str, data: bytes, mode: int = 0o644,
                 user: UserIds | None = None) -> None:
        self.client(handle).put_file(path, data, mode, self.agent_user(handle, user))

    def get_file(self, handle: SandboxHandle, path: str, user: UserIds | None = None) -> bytes:
        return self.client(handle).get_file(path, self.agent_user(handle, user))

    def get_file_with_mode(self, handle: SandboxHandle, path: str,
                           user: UserIds | None = None) -> tuple[bytes, int]:
        return self.client(handle).get_file_with_mode(path, self.agent_user(handle, user))

    def put_stream(self, handle: SandboxHandle, path: str, src: BinaryIO,
                   mode: int = 0o644) -> int:
        return self.client(handle).put_stream(path, src, mode)

    def get_tree(self, handle: SandboxHandle, path: str, sink: TreeSink) -> None:
        self.client(handle).get_tree(path, sink)


def bind_agent_socket(path: Path) -> socket.socket:
    """A unix socket bound at `path` but not listening: the agent is handed it as fd
    AGENT_SOCKET_FD and listens on it itself, so the listener the host's SO_PEERCRED check
    sees is the agent. `path` must be in a directory no sandbox can see or write."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(path) as address:
            sock.bind(address)
    except OSError:
        sock.close()
        raise
    # above the fds a spawn places (0-4), so no placement overwrites it before its own
    high = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
    sock.close()
    return socket.socket(fileno=high)


def in_cgroup(pid: int, cgroup: str) -> bool:
    """Whether process `pid` is in `cgroup` (or below it) in any hierarchy."""
    want = "/" + cgroup.strip("/")
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return any(p == want or p.startswith(want + "/")
               for p in (ln.split(":", 2)[-1] for ln in lines))


class CgroupAgentBackend(AgentBackend):
    """Sandboxes on this kernel, in one cgroup each, with the agent listening on a socket
    the host bound at ``state["agent_sock"]``, outside anything the sandbox can see."""

    @staticmethod
    def _agent_socket(handle: SandboxHandle) -> tuple[str, PeerCheck]:
        """The agent's socket path, and the check that its listener is the sandbox's."""
        st = handle.state
        # sandboxes created before the socket moved out of their reach listened in run_dir:
        # still reachable, and the peer check is what keeps that path honest
        path = st.get("agent_sock") or str(Path(st["run_dir"]) / "agent.sock")
        pid, cgroup = st.get("pid"), str(st.get("cgroup") or "")

        def ours(peer: int) -> bool:
            return peer == pid or (bool(cgroup) and in_cgroup(peer, cgroup))

        return path, ours

    def _connect(self, handle: SandboxHandle) -> AgentClient:
        path, ours = self._agent_socket(handle)
        return AgentClient.connect_unix(path, peer=ours, what=f"sandbox {handle.sandbox_id}")

    async def connect_async(self, handle: SandboxHandle) -> AsyncAgentClient:
        """A new asyncio connection to the sandbox's agent, checked as `_connect` is."""
        path, ours = self._agent_socket(handle)
        return await AsyncAgentClient.connect_unix(path, peer=ours,
                                                   what=f"sandbox {handle.sandbox_id}")

    supports_pause = True  # the cgroup freezer

    def pause(self, handle: SandboxHandle) -> None:
        _cgroups.Cgroup(handle.state["cgroup"]).freeze()

    def resume(self, handle: SandboxHandle) -> None:
        _cgroups.Cgroup(handle.state["cgroup"]).thaw()

    def is_alive(self, handle: SandboxHandle) -> bool:
        return _rootfs.alive(handle.state.get("pid"), handle.state.get("start_time"))

    def is_paused(self, handle: SandboxHandle) -> bool:
        return _cgroups.Cgroup(handle.state["cgroup"]).frozen()

    def exec(self, handle: SandboxHandle, request: ExecRequest,
             on_output: OutputCallback | None = None) -> ExecResult:
        return exec_with_accounting(self.client(handle), handle, request, on_output)


async def exec_async(client: AsyncAgentClient, handle: SandboxHandle, request: ExecRequest,
                     on_output: AsyncOutputCallback | None = None) -> ExecResult:
    """`exec_with_accounting` on an asyncio connection: the same result, limit flags
    included, awaited without a thread."""
    watch = _LimitWatch(handle)
    res = await client.exec(request.argv, request.env, request.cwd,
                            request.stdin,  # type: ignore[arg-type]
                            request.timeout, on_output, request.capture_limit, request.user)
    return watch.result(res)


def exec_with_accounting(client: AgentClient, handle: SandboxHandle, request: ExecRequest,
                         on_output: OutputCallback | None) -> ExecResult:
    """Exec through the agent and tell the caller when the sandbox's memory or pids limit
    was what ended the command (cgroup counters read before and after)."""
    watch = _LimitWatch(handle)
    res = client.exec(request.argv, request.env, request.cwd, request.stdin, request.timeout,
                      on_output, request.capture_limit, request.user)
    return watch.result(res)


class _LimitWatch:
    """The sandbox's memory and pids limit counters, read before an exec and again after
    it: `result` flags the limit that ended the command."""

    def __init__(self, handle: SandboxHandle) -> None:
        limited = handle.state.get("limited", True) and handle.state.get("cgroup")
        self.cg = _cgroups.Cgroup(handle.state["cgroup"]) if limited else None
        self.before = self.cg.limit_events() if self.cg else (0, 0)
        self.t0 = time.monotonic()

    def result(self, res: ExecResult) -> ExecResult:
        if self.cg is None:
            return res
        after = self.cg.limit_events()
        oom, pids_hit = after[0] > self.before[0], after[1] > self.before[1]
        if not (oom or pids_hit):
            return res
        return dataclasses.replace(res, duration=time.monotonic() - self.t0, oom_killed=oom,
                                   pids_limited=pids_hit)
