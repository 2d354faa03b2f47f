"""Backends whose sandboxes run dsec-agent as their init: one cached agent connection per
sandbox (so a warm exec is one round trip), and exec and file transfer through it.

`AgentBackend` needs only `_connect`; `CgroupAgentBackend` adds what sandboxes whose
processes share one cgroup have in common (freezer pause, limit accounting on exec)."""

from __future__ import annotations

import abc
import threading
import time
from pathlib import Path

from ..agent.client import AgentClient
from . import _cgroups, _rootfs
from .base import Backend, ExecRequest, ExecResult, OutputCallback, SandboxHandle


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
            if c is not None and c._closed is None:
                return c
        c = self._connect(handle)
        with self._lock:
            old = self._clients.get(handle.sandbox_id)
            if old is not None and old._closed is None:  # another thread connected first
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

    def exec(self, handle: SandboxHandle, request: ExecRequest,
             on_output: OutputCallback | None = None) -> ExecResult:
        return self.client(handle).exec(request.argv, request.env, request.cwd, request.stdin,
                                        request.timeout, on_output)

    def put_file(self, handle: SandboxHandle, path: str, data: bytes, mode: int = 0o644) -> None:
        self.client(handle).put_file(path, data, mode)

    def get_file(self, handle: SandboxHandle, path: str) -> bytes:
        return self.client(handle).get_file(path)


class CgroupAgentBackend(AgentBackend):
    """Sandboxes on this kernel, in one cgroup each, with the agent on a unix socket in
    ``state["run_dir"]``."""

    def _connect(self, handle: SandboxHandle) -> AgentClient:
        return AgentClient.connect_unix(Path(handle.state["run_dir"]) / "agent.sock")

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


def exec_with_accounting(client: AgentClient, handle: SandboxHandle, request: ExecRequest,
                         on_output: OutputCallback | None) -> ExecResult:
    """Exec through the agent and tell the caller when the sandbox's memory or pids limit
    was what ended the command (cgroup counters read before and after)."""
    limited = handle.state.get("limited", True) and handle.state.get("cgroup")
    cg = _cgroups.Cgroup(handle.state["cgroup"]) if limited else None
    before = cg.limit_events() if cg else (0, 0)
    t0 = time.monotonic()
    res = client.exec(request.argv, request.env, request.cwd, request.stdin, request.timeout,
                      on_output)
    if cg is None:
        return res
    after = cg.limit_events()
    oom, pids_hit = after[0] > before[0], after[1] > before[1]
    if not (oom or pids_hit):
        return res
    return ExecResult(res.exit_code, res.stdout, res.stderr, time.monotonic() - t0,
                      res.timed_out, oom_killed=oom, pids_limited=pids_hit)
