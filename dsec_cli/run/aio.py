"""This node's sandboxes awaited from an event loop (`AsyncNode`), without a thread per
sandbox or per exec.

Work inside a container or fncall sandbox (exec, put, get) goes over an asyncio connection
to its agent (`backends/sandbox_agent/aio.py`), one per sandbox and event loop, so any
number of execs wait in the loop itself. What has no asyncio path (creating or removing a
runtime, pause, snapshot, fork, and the work inside VMs, whose agent port serves one
connection at a time, held by the node's threaded client) runs on one shared executor
of a bounded number of threads (`executor()`), whatever the number of sandboxes.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
import weakref
from collections.abc import AsyncIterable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..backends import ExecRequest, ExecResult, SandboxHandle, UserIds
from ..backends.agented import CgroupAgentBackend, exec_async
from ..backends.sandbox_agent.aio import AsyncAgentClient, AsyncOutputCallback, AsyncStdin
from ..backends.sandbox_agent.client import AgentError
from .lifecycle import check_exec, sandbox_path
from .node import CreateOptions, Node
from .state import SandboxRecord

__all__ = ["AsyncNode", "async_node", "blocking", "close_connections", "executor",
           "EXECUTOR_THREADS"]

T = TypeVar("T")

#: threads of the shared executor: the bound on blocking calls (creates, removes, ...) in
#: flight at once, for every event loop of the process
EXECUTOR_THREADS = min(16, (os.cpu_count() or 1) + 4)

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """The process's one executor for blocking sandbox operations."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="dsec-aio")
        return _executor


async def blocking(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)`` on the shared executor, awaited."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor(), functools.partial(fn, *args, **kw))


def _threadsafe(cb: AsyncOutputCallback | None) -> Callable[[str, bytes], None] | None:
    """An output callback for a call running on the executor: each chunk is handed to the
    event loop (a coroutine callback is scheduled there, in order)."""
    if cb is None:
        return None
    loop = asyncio.get_running_loop()
    running: set[asyncio.Future[Any]] = set()  # a task nothing references may be collected

    def on_loop(kind: str, data: bytes) -> None:
        r = cb(kind, data)
        if inspect.isawaitable(r):
            fut = asyncio.ensure_future(r)
            running.add(fut)
            fut.add_done_callback(running.discard)

    def from_thread(kind: str, data: bytes) -> None:
        loop.call_soon_threadsafe(on_loop, kind, data)

    return from_thread


async def _whole(stdin: AsyncStdin) -> bytes | None:
    if stdin is None or isinstance(stdin, bytes):
        return stdin
    if isinstance(stdin, str):
        return stdin.encode()
    if isinstance(stdin, AsyncIterable):
        return b"".join([b async for b in stdin])
    return b"".join(stdin)


class AsyncNode:
    """The node contract's sandbox operations on this machine's `Node`, as coroutines.
    Bound to one event loop (see `async_node`)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._clients: dict[str, AsyncAgentClient] = {}
        self._connecting: dict[str, asyncio.Lock] = {}

    @property
    def name(self) -> str:
        return "local"

    # -- lifecycle: on the shared executor -----------------------------------------------------
    async def create(self, image: str, opts: CreateOptions | None = None) -> SandboxRecord:
        return await blocking(self.node.create, image, opts)

    async def lookup(self, sid: str) -> SandboxRecord:
        return self.node.lookup(sid)  # one indexed sqlite read

    async def describe(self, sid: str) -> dict[str, Any]:
        return await blocking(self.node.describe, sid)

    async def pause(self, sid: str) -> SandboxRecord:
        return await blocking(self.node.pause, sid)

    async def resume(self, sid: str) -> SandboxRecord:
        return await blocking(self.node.resume, sid)

    async def snapshot(self, sid: str, ref: str, push: str | None = None, *,
                       replace: bool = False) -> dict[str, Any]:
        return await blocking(self.node.snapshot, sid, ref, push, replace=replace)

    async def fork(self, sid: str, n: int) -> dict[str, Any]:
        return await blocking(self.node.fork, sid, n)

    async def remove(self, sid: str) -> SandboxRecord:
        rec = self.node.lookup(sid)
        self._connecting.pop(rec.id, None)
        client = self._clients.pop(rec.id, None)
        if client is not None:
            await client.close()
        return await blocking(self.node.remove, rec.id)

    async def copy(self, src: str, dst: str) -> dict[str, Any]:
        from .transfer import copy

        return await blocking(copy, self.node, src, dst)

    # -- work inside: over the agent's socket where there is one ---------------------------------
    async def _client(self, rec: SandboxRecord, b: CgroupAgentBackend,
                      h: SandboxHandle) -> AsyncAgentClient:
        c = self._clients.get(rec.id)
        if c is not None and c.closed is None:
            return c
        lock = self._connecting.setdefault(rec.id, asyncio.Lock())
        async with lock:
            c = self._clients.get(rec.id)
            if c is None or c.closed is not None:
                c = self._clients[rec.id] = await b.connect_async(h)
            return c

    async def _agent(self, sid: str) -> tuple[SandboxRecord, Any, SandboxHandle,
                                              AsyncAgentClient | None]:
        rec, b, h = self.node.live(sid)
        if not isinstance(b, CgroupAgentBackend):
            return rec, b, h, None
        return rec, b, h, await self._client(rec, b, h)

    def _lost(self, sid: str, client: AsyncAgentClient) -> None:
        if self._clients.get(sid) is client:
            del self._clients[sid]

    async def exec(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: AsyncStdin = None,
                   timeout: float | None = None, on_output: AsyncOutputCallback | None = None,
                   capture_limit: int | None = None, user: str | None = None) -> ExecResult:
        """As `Node.exec`: ``user`` (NAME, UID, NAME:GROUP, UID:GID) overrides the
        sandbox's user."""
        check_exec(argv, timeout)
        rec, b, h, client = await self._agent(sid)
        if client is None:
            data = await _whole(stdin)
            return await blocking(self.node.exec, rec.id, list(argv), env=env, cwd=cwd,
                                  stdin=data, timeout=timeout,
                                  on_output=_threadsafe(on_output),
                                  capture_limit=capture_limit, user=user)
        req = ExecRequest(list(argv), dict(env or {}), cwd, stdin,  # type: ignore[arg-type]
                          timeout, capture_limit, await self._agent_user(rec, b, h, user))
        with self.node.working(rec.id):  # as `Node.exec`: the idle time counts from here
            try:
                return await exec_async(client, h, req, on_output)
            except AgentError:
                self._lost(rec.id, client)
                raise

    async def _agent_user(self, rec: SandboxRecord, b: Any, h: SandboxHandle,
                         user: str | None) -> UserIds | None:
        """The ids an exec or file request on the loop's connection carries: the sandbox's
        user or ``user``, as the backend's agent takes them (`Node.exec_user`)."""
        ids = self.node.exec_user(rec, user) if user is None else \
            await blocking(self.node.exec_user, rec, user)  # reads the sandbox's passwd
        return b.agent_user(h, ids)  # type: ignore[no-any-return]

    async def put_file(self, sid: str, path: str, data: bytes, mode: int = 0o644,
                       user: str | None = None) -> None:
        """As `Node.put_file`: as the sandbox's user, or ``user``."""
        path = sandbox_path(path)
        rec, b, h, client = await self._agent(sid)
        if client is None:
            return await blocking(self.node.put_file, rec.id, path, data, mode, user)
        ids = await self._agent_user(rec, b, h, user)
        try:
            await client.put_file(path, data, mode, ids)
        except AgentError:
            self._lost(rec.id, client)
            raise

    async def get_file_with_mode(self, sid: str, path: str, user: str | None = None
                                 ) -> tuple[bytes, int]:
        path = sandbox_path(path)
        rec, b, h, client = await self._agent(sid)
        if client is None:
            return await blocking(self.node.get_file_with_mode, rec.id, path, user)
        ids = await self._agent_user(rec, b, h, user)
        try:
            return await client.get_file_with_mode(path, ids)
        except AgentError:
            self._lost(rec.id, client)
            raise

    async def get_file(self, sid: str, path: str, user: str | None = None) -> bytes:
        return (await self.get_file_with_mode(sid, path, user))[0]

    async def forget(self, sid: str) -> None:
        """Close the loop's connection to a sandbox removed by other means (a job's)."""
        self._connecting.pop(sid, None)
        client = self._clients.pop(sid, None)
        if client is not None:
            await client.close()

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, AsyncNode]] = \
    weakref.WeakKeyDictionary()


def async_node(node: Node) -> AsyncNode:
    """The running event loop's `AsyncNode` for a `Node` (its agent connections are shared
    by every coroutine of the loop)."""
    per_loop = _loops.setdefault(asyncio.get_running_loop(), {})
    an = per_loop.get(id(node))
    if an is None or an.node is not node:
        an = per_loop[id(node)] = AsyncNode(node)
    return an


async def close_connections() -> None:
    """Close the running loop's agent connections."""
    for an in list(_loops.pop(asyncio.get_running_loop(), {}).values()):
        await an.aclose()
