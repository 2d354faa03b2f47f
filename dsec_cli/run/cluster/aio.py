"""A cluster node awaited from an event loop (`AsyncRemoteNode`): the node protocol of
remote.py over an asyncio subprocess (``ssh node dsec agent --stdio`` on the node's shared
SSH connection), so requests to any number of sandboxes wait in the loop, not in threads.

One `AsyncChannel` per node and event loop multiplexes every request by id; a reader task
routes each reply and each exec output event to its waiting caller. Failures are typed as
for `RemoteNode`: the session dying or a bounded wait running out is `NodeUnreachableError`,
retried only for opening a channel and for read-only requests; a node's lines are cut by
`protocol.Lines` as in remote.py, and one past its bound is a `NodeCommandError`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from typing import Any

from ...backends.base import ExecResult
from ...backends.sandbox_agent.aio import AsyncOutputCallback, AsyncStdin
from ...core.config import net_timeouts
from ...core.errors import DsecError, NodeUnreachableError
from ...core.mux import InFlight
from ..aio import _whole, blocking
from ..lifecycle import check_exec
from ..options import CreateOptions
from .errors import NodeCommandError
from .protocol import (
    PROTOCOL_VERSION,
    Lines,
    encode,
)
from .remote import (
    READ_CHUNK,
    STDERR_KEPT,
    Attempts,
    Call,
    NodeEntry,
    NodeRequests,
    RemoteRecord,
    T,
    event_of,
    no_answer,
    refuse_user,
    result_of,
    route,
    session_failure,
)

log = logging.getLogger(__name__)

_EOF: dict[str, Any] = {"eof": True}


class AsyncChannel:
    """One node service session, read by a task of the loop that opened it."""

    def __init__(self, entry: NodeEntry, proc: asyncio.subprocess.Process) -> None:
        self.name, self.proc = entry.name, proc
        self._pending: InFlight[asyncio.Queue[dict[str, Any]]] = InFlight()
        self._stderr: list[bytes] = []
        self._broken: DsecError | None = None  # the node broke the protocol (not retried)
        self.closed = False
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._drain_err())]

    @classmethod
    async def open(cls, entry: NodeEntry, timeout: float) -> AsyncChannel:
        # the ControlMaster is started (or checked) once per node by the threaded code
        await blocking(entry.target.ensure_master, entry.name)
        proc = await asyncio.create_subprocess_exec(
            *entry.target.command_argv(entry.remote_command()), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        ch = cls(entry, proc)
        greet = min(timeout, net_timeouts().read)
        try:
            await ch.call("hello", {"version": PROTOCOL_VERSION}, timeout=greet)
        except BaseException:
            await ch.close()
            raise
        return ch

    async def _drain_err(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(READ_CHUNK):  # kept: the last few reads
            self._stderr.append(chunk)
            del self._stderr[:-STDERR_KEPT]

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        lines = Lines(self.name)
        try:
            while chunk := await self.proc.stdout.read(READ_CHUNK):
                for line in lines.feed(chunk):
                    route(self._pending, line, self.name)
        except NodeCommandError as e:  # a line past the bound: nothing more is read
            self._broken = e
            if self.proc.returncode is None:
                self.proc.kill()
        except OSError as e:  # the pipe broke
            log.warning("%s: node service stream failed: %s", self.name, e)
        self.closed = True
        for q in self._pending.waiting():
            q.put_nowait(_EOF)

    async def failure(self) -> DsecError:
        if self._broken is not None:
            await self.close()
            return self._broken
        try:
            rc: int | None = await asyncio.wait_for(self.proc.wait(), 2)
        except TimeoutError:
            rc = None
        return session_failure(self.name, self._stderr, rc)

    async def call(self, op: str, args: dict[str, Any] | None = None, *,
                   timeout: float | None = None,
                   on_event: AsyncOutputCallback | None = None) -> Any:
        if self.closed:
            raise await self.failure()
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        rid = self._pending.add(q)
        assert rid is not None  # never closed: the channel's own flag says so
        try:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(encode({"id": rid, "op": op, "args": args or {}}))
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.closed = True
                raise await self.failure() from None
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    msg = await asyncio.wait_for(q.get(), left)
                except TimeoutError:
                    raise no_answer(self.name, op, timeout) from None
                if msg is _EOF:
                    raise await self.failure()
                event = event_of(msg)
                if event is None:
                    return result_of(msg, self.name)
                if on_event is not None:
                    r = on_event(*event)
                    if inspect.isawaitable(r):
                        await r
        finally:
            self._pending.done(rid)

    async def close(self) -> None:
        self.closed = True
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the node service finishes what is in flight, exits
                await asyncio.wait_for(self.proc.wait(), 5)
            except (TimeoutError, OSError):
                self.proc.kill()
                await self.proc.wait()
        for t in self._tasks:
            t.cancel()
        # the pipes are closed here, in the loop: a stdout left paused after a refused line
        # would otherwise be closed by the transport's finalizer once the loop has gone
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()


_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                     dict[tuple[Any, ...], AsyncChannel]] = \
    weakref.WeakKeyDictionary()
_opening: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                    dict[tuple[Any, ...], asyncio.Lock]] = \
    weakref.WeakKeyDictionary()


async def channel(entry: NodeEntry, timeout: float) -> AsyncChannel:
    """The running loop's channel to a node, opened on first use and reopened if it died."""
    loop = asyncio.get_running_loop()
    chans = _channels.setdefault(loop, {})
    ch = chans.get(entry.key())
    if ch is not None and not ch.closed:
        return ch
    async with _opening.setdefault(loop, {}).setdefault(entry.key(), asyncio.Lock()):
        ch = chans.get(entry.key())
        if ch is None or ch.closed:
            ch = chans[entry.key()] = await AsyncChannel.open(entry, timeout)
        return ch


async def close_channels() -> None:
    """Close the running loop's node sessions (their ssh processes exit)."""
    chans = _channels.pop(asyncio.get_running_loop(), {})
    for ch in chans.values():
        await ch.close()


class AsyncRemoteNode(NodeRequests):
    """`RemoteNode`'s sandbox operations as coroutines, over the loop's channel: the same
    requests (`NodeRequests`), awaited."""

    async def call(self, op: str, args: dict[str, Any] | None = None, *,
                   timeout: float | None = None,
                   on_event: AsyncOutputCallback | None = None) -> Any:
        attempts = Attempts(op, net_timeouts().total)
        while True:
            try:
                ch = await channel(self.entry, self.timeout)
            except NodeUnreachableError:
                wait = attempts.retry(sent=False)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            try:
                return await ch.call(op, args, timeout=timeout, on_event=on_event)
            except NodeUnreachableError:
                await ch.close()
                wait = attempts.retry(sent=True)
                if wait is None:
                    raise
                await asyncio.sleep(wait)

    async def send(self, c: Call[T], on_event: AsyncOutputCallback | None = None) -> T:
        return c.shape(await self.call(c.op, c.args, timeout=c.timeout, on_event=on_event))

    async def create(self, image: str, opts: CreateOptions | None = None) -> RemoteRecord:
        return await self.send(self.create_call(image, opts))

    async def lookup(self, sid: str) -> RemoteRecord:
        return await self.send(self.lookup_call(sid))

    async def describe(self, sid: str) -> dict[str, Any]:
        return await self.send(self.describe_call(sid))

    async def pause(self, sid: str) -> RemoteRecord:
        return await self.send(self._on("pause", sid, self._rec))

    async def resume(self, sid: str) -> RemoteRecord:
        return await self.send(self._on("resume", sid, self._rec))

    async def remove(self, sid: str) -> RemoteRecord:
        return await self.send(self._on("remove", sid, self._rec))

    async def snapshot(self, sid: str, ref: str, push: str | None = None, *,
                       replace: bool = False) -> dict[str, Any]:
        return await self.send(self.snapshot_call(sid, ref, push, replace))

    async def fork(self, sid: str, n: int) -> dict[str, Any]:
        return await self.send(self.fork_call(sid, n))

    async def exec(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: AsyncStdin = None,
                   timeout: float | None = None, on_output: AsyncOutputCallback | None = None,
                   capture_limit: int | None = None, user: str | None = None) -> ExecResult:
        refuse_user(user)
        check_exec(argv, timeout)
        data = await _whole(stdin)  # the protocol sends stdin whole
        return await self.send(self.exec_call(sid, argv, env, cwd, data, timeout,
                                              on_output is not None, capture_limit), on_output)

    async def put_file(self, sid: str, path: str, data: bytes, mode: int = 0o644,
                       user: str | None = None) -> None:
        """As the sandbox's user on its node (the node service's default)."""
        refuse_user(user)
        await self.send(self.put_call(sid, path, data, mode))

    async def get_file_with_mode(self, sid: str, path: str, user: str | None = None
                                 ) -> tuple[bytes, int]:
        refuse_user(user)
        return await self.send(self.get_call(sid, path))

    async def get_file(self, sid: str, path: str, user: str | None = None) -> bytes:
        return (await self.get_file_with_mode(sid, path, user))[0]

    async def copy(self, src: str, dst: str) -> dict[str, Any]:
        from .api import copy_remote

        return await blocking(copy_remote, src, dst, None, None)
