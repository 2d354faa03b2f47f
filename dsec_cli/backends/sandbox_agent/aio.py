"""The asyncio client of the dsec-agent protocol (docs/agent.md): the same frames as
`client.AgentClient`, on asyncio streams, with no thread at all.

One `AsyncAgentClient` owns one connection to one agent and multiplexes requests over it by
id: a reader task (not a thread) routes each frame to the request waiting for it, so any
number of execs, puts and gets of any number of sandboxes wait in one event loop. Like the
threaded client, it is opened only by `connect_unix`, which checks who listens on the other
end (SO_PEERCRED) before a byte is sent; it reads frames through the same bounded
`frames.FrameReader` and keeps an exec's deadline the same way (`client.ExecFrames`).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import struct
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from pathlib import Path

from ...core.files import unix_address
from ...core.mux import InFlight
from ..base import ExecResult, UserIds
from .client import (
    CHUNK,
    EXEC_F_STDIN,
    KILL_GRACE,
    T_DATA,
    T_EXEC,
    T_GET,
    T_PING,
    T_RESULT,
    T_SIGNAL,
    T_STDIN,
    AgentError,
    ExecFrames,
    PeerCheck,
    _encode_exec,
    _result,
    check_file_result,
    check_peer,
    file_reply,
    file_request,
    kill_listener,
    put_requests,
)
from .frames import HEADER as _HDR
from .frames import FrameReader, frame

#: called with ("stdout" | "stderr", bytes) as output arrives; may be a coroutine function
AsyncOutputCallback = Callable[[str, bytes], Awaitable[None] | None]
#: what an async exec's stdin may be: bytes, or blocks from a (sync or async) iterable
AsyncStdin = bytes | str | Iterable[bytes] | AsyncIterable[bytes] | None

_LOST = -1


class AsyncAgentClient:
    """A multiplexed asyncio connection to one dsec-agent. Bound to the event loop that
    opened it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 what: str = "the sandbox", agent: int = -1) -> None:
        self._reader, self._writer, self.what, self._agent = reader, writer, what, agent
        self._pending: InFlight[asyncio.Queue[tuple[int, bytes]]] = InFlight()
        self.closed: str | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect_unix(cls, path: str | Path, *, peer: PeerCheck,
                           what: str = "the sandbox", timeout: float = 10.0
                           ) -> AsyncAgentClient:
        """Connect to an agent's unix socket (any path length) and refuse it unless
        `peer(pid)` accepts the listening process, as `AgentClient.connect_unix` does."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with unix_address(path) as target:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, target),
                                       timeout)
        except (TimeoutError, OSError) as e:
            sock.close()
            reason = getattr(e, "strerror", None) or str(e) or "timed out"
            raise AgentError(f"cannot connect to the sandbox agent at {path}: {reason}") from e
        agent = check_peer(sock, peer, what, path)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=CHUNK)
        return cls(reader, writer, what, agent)

    def _drop_agent(self) -> int:
        agent, self._agent = self._agent, -1
        if agent >= 0:
            os.close(agent)
        return agent

    def kill_agent(self, why: str) -> None:
        """Kill the agent (it stopped answering) and drop the connection."""
        if self._agent >= 0:
            kill_listener(self._agent, self.what, why)
        self._drop_agent()
        self._task.cancel()
        self._writer.close()

    async def close(self) -> None:
        self._drop_agent()
        self._task.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (OSError, asyncio.CancelledError):
            pass
        if self.closed is None:
            self.closed = "closed"

    # -- plumbing ------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        reason = "closed"
        frames = FrameReader(self.what)
        try:
            while data := await self._reader.read(CHUNK):
                for kind, rid, payload in frames.feed(data):
                    q = self._pending.get(rid)
                    if q is not None:
                        q.put_nowait((kind, payload))
            reason = "the agent closed the connection"
        except AgentError as e:  # a frame past the bound: nothing more is read from it
            reason = e.message
        except OSError as e:
            reason = str(e) or type(e).__name__
        except asyncio.CancelledError:
            reason = "closed"
        self.closed = reason
        self._writer.close()
        for q in self._pending.close(reason):
            q.put_nowait((_LOST, reason.encode()))

    def _open(self) -> tuple[int, asyncio.Queue[tuple[int, bytes]]]:
        q: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        rid = None if self.closed is not None else self._pending.add(q)
        if rid is None:
            raise AgentError(f"the sandbox agent connection is closed: {self.closed}")
        return rid, q

    async def _send(self, kind: int, rid: int, payload: bytes) -> None:
        data = frame(kind, rid, payload)
        if self.closed is not None:
            raise AgentError(f"lost the connection to the sandbox agent: {self.closed}")
        try:
            # write() appends whole frames to the transport's buffer: frames of concurrent
            # requests never interleave; drain() waits while the agent reads slowly
            self._writer.write(data)
            await self._writer.drain()
        except OSError as e:
            raise AgentError(f"lost the connection to the sandbox agent: {e}") from e

    async def _wait_result(self, rid: int, q: asyncio.Queue[tuple[int, bytes]],
                           sink: list[bytes] | None = None) -> tuple[int, str]:
        try:
            while True:
                kind, payload = await q.get()
                if kind == T_RESULT:
                    return _result(payload)
                if kind == T_DATA and sink is not None:
                    sink.append(payload)
                elif kind == _LOST:
                    raise AgentError("lost the connection to the sandbox agent: "
                                     f"{payload.decode()}")
        finally:
            self._pending.done(rid)

    # -- requests ------------------------------------------------------------------------------
    async def ping(self) -> str:
        rid, q = self._open()
        await self._send(T_PING, rid, b"")
        return (await self._wait_result(rid, q))[1]

    async def exec(self, argv: list[str], env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: AsyncStdin = None,
                   timeout: float | None = None, on_output: AsyncOutputCallback | None = None,
                   capture_limit: int | None = None, user: UserIds | None = None
                   ) -> ExecResult:
        """Run argv in the sandbox; output goes to `on_output` as it arrives. Cancelling the
        awaiting task kills the command (SIGKILL) in the sandbox."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        payload = _encode_exec(list(argv), dict(env or {}), cwd,
                               EXEC_F_STDIN if stdin is not None else 0, timeout, user)
        rid, q = self._open()
        started = time.monotonic()
        feeder: asyncio.Task[None] | None = None
        finished = False
        try:
            await self._send(T_EXEC, rid, payload)
            if isinstance(stdin, bytes | bytearray):
                await self._feed(rid, [bytes(stdin)])
            elif stdin is not None:
                # a stream is fed alongside: the result comes when the process exits, even
                # if the stream never ends
                feeder = asyncio.get_running_loop().create_task(self._feed(rid, stdin))
            result = await self._collect(rid, q, ExecFrames(started, capture_limit, timeout),
                                         on_output)
            finished = True
            return result
        finally:
            if feeder is not None:
                feeder.cancel()
            if not finished:  # abandoned (cancelled, or a callback raised): nothing may run on
                self._kill_nowait(rid)
            self._pending.done(rid)

    def _kill_nowait(self, rid: int) -> None:
        """SIGKILL an exec through the agent: queued on the transport, never awaited, so an
        agent that reads nothing cannot hold the caller."""
        if self.closed is None and not self._writer.is_closing():
            self._writer.write(_HDR.pack(9, T_SIGNAL, rid) + struct.pack(">I", signal.SIGKILL))

    async def _feed(self, rid: int, blocks: Iterable[bytes] | AsyncIterable[bytes]) -> None:
        try:
            if isinstance(blocks, AsyncIterable):
                async for block in blocks:
                    await self._send_stdin(rid, block)
            else:
                for block in blocks:
                    await self._send_stdin(rid, block)
            await self._send(T_STDIN, rid, b"")
        except (AgentError, OSError):
            pass  # the exec (or the connection) is gone: nothing left to feed

    async def _send_stdin(self, rid: int, data: bytes) -> None:
        for i in range(0, len(data), CHUNK):
            await self._send(T_STDIN, rid, data[i:i + CHUNK])

    async def _collect(self, rid: int, q: asyncio.Queue[tuple[int, bytes]], fold: ExecFrames,
                       on_output: AsyncOutputCallback | None) -> ExecResult:
        """The exec's result from its frames; at its deadline (on this host's clock) the
        command is killed through the agent, or with the agent (`ExecFrames.lapse`)."""
        while True:
            try:
                kind, payload = await asyncio.wait_for(q.get(), fold.left())
            except TimeoutError:
                if fold.lapse():
                    self._kill_nowait(rid)
                    continue
                self.kill_agent("an exec's deadline passed and the agent did not report it "
                                f"killed within {KILL_GRACE:g}s")
                return fold.timed_out()
            stream = ExecFrames.stream(kind)
            if stream is not None and on_output is not None:
                r = on_output(stream, payload)
                if inspect.isawaitable(r):
                    await r
            result = fold.add(kind, payload)
            if result is not None:
                return result

    async def put_file(self, path: str, data: bytes, mode: int = 0o644,
                       user: UserIds | None = None) -> None:
        """As `AgentClient.put_file`: as the agent, or with `user`'s ids."""
        for kind, payload in put_requests(path, data, mode, user):
            rid, q = self._open()
            await self._send(kind, rid, payload)
            code, msg = await self._wait_result(rid, q)
            check_file_result(code, msg, path, user)

    async def get_file_with_mode(self, path: str, user: UserIds | None = None
                                 ) -> tuple[bytes, int]:
        kind, payload = file_request(T_GET, path.encode(), user)
        rid, q = self._open()
        await self._send(kind, rid, payload)
        sink: list[bytes] = []
        code, msg = await self._wait_result(rid, q, sink)
        check_file_result(code, msg, path, user)
        return file_reply(sink)

    async def get_file(self, path: str, user: UserIds | None = None) -> bytes:
        return (await self.get_file_with_mode(path, user))[0]
