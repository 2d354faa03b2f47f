"""A command left running in a sandbox (`AsyncSandbox.spawn`): a server, a watcher, a test
run whose output the caller reads when it comes back to it.

The output is kept as it arrives, up to ``keep`` bytes in all (the oldest is dropped past
that, and counted), so a caller may drain it now and then with `read`, iterate it as
events, or only `wait` for the result. Stdin stays open for `write` until `close_stdin`.
Killing the process (or cancelling the task that awaits it) kills the command in the
sandbox. A spawned command is not a journaled step of a job: a replay does not re-run it.
"""

from __future__ import annotations

import asyncio
import collections
import signal
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..backends import ExecResult
from ..core.errors import UsageError

if TYPE_CHECKING:
    from .aio import AsyncSandbox

__all__ = ["AsyncProcess", "DEFAULT_KEEP"]

#: output kept for a reader who has not come back, over both streams (bytes)
DEFAULT_KEEP = 16 << 20


class AsyncProcess:
    """A running command's handle: its output so far, its stdin, its end."""

    def __init__(self, sandbox: AsyncSandbox, argv: list[str], *,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 user: str | None = None, keep: int = DEFAULT_KEEP) -> None:
        if keep <= 0:
            raise UsageError(f"spawn keep= must be a positive number of bytes, not {keep}")
        self.sandbox, self.argv, self.keep = sandbox, list(argv), keep
        # each stream's unread chunks, numbered in arrival order across both streams
        self._chunks: dict[str, collections.deque[tuple[int, bytes]]] = {
            "stdout": collections.deque(), "stderr": collections.deque()}
        self._seq = 0
        self._kept = 0
        self.dropped = 0  #: bytes of output dropped because nobody read them in time
        self._arrived = asyncio.Event()
        self._stdin: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._stdin_closed = False
        self.result: ExecResult | None = None
        kw: dict[str, Any] = {} if user is None else {"user": user}
        # the exec result keeps only what the handle keeps: the rest went to the reader
        self._task = asyncio.ensure_future(sandbox.node.exec(
            sandbox.id, self.argv, env=env, cwd=cwd, stdin=self._stdin_blocks(),
            on_output=self._output, capture_limit=keep, **kw))
        self._task.add_done_callback(lambda _t: self._arrived.set())

    # -- output --------------------------------------------------------------------------------
    def _output(self, stream: str, data: bytes) -> None:
        self._chunks[stream].append((self._seq, bytes(data)))
        self._seq += 1
        self._kept += len(data)
        while self._kept > self.keep:  # drop the oldest bytes: whole chunks, or a head
            name = self._oldest()
            seq, old = self._chunks[name].popleft()
            cut = min(self._kept - self.keep, len(old))
            if cut < len(old):
                self._chunks[name].appendleft((seq, old[cut:]))
            self._kept -= cut
            self.dropped += cut
        self._arrived.set()

    def _oldest(self) -> str:
        out, err = self._chunks["stdout"], self._chunks["stderr"]
        return "stdout" if out and (not err or out[0][0] < err[0][0]) else "stderr"

    def _take(self, stream: str) -> bytes:
        _, data = self._chunks[stream].popleft()
        self._kept -= len(data)
        return data

    def read(self) -> tuple[bytes, bytes]:
        """The stdout and stderr that arrived since the last read (or iteration)."""
        out = b"".join(self._take("stdout") for _ in range(len(self._chunks["stdout"])))
        err = b"".join(self._take("stderr") for _ in range(len(self._chunks["stderr"])))
        return out, err

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        """``(stream, data)`` chunks of both streams in the order they arrived, until the
        command ends."""
        return self._follow(("stdout", "stderr"))

    def stream(self, name: str) -> AsyncIterator[bytes]:
        """One stream's chunks (``"stdout"`` or ``"stderr"``), until the command ends; the
        other stream's are kept for its own reader."""
        if name not in self._chunks:
            raise UsageError(f"no output stream {name!r}: stdout or stderr")
        return (data async for _, data in self._follow((name,)))

    async def _follow(self, names: tuple[str, ...]) -> AsyncIterator[tuple[str, bytes]]:
        while True:
            while any(self._chunks[n] for n in names):
                name = self._oldest() if len(names) > 1 else names[0]
                yield name, self._take(name)
            if self._task.done():
                return
            self._arrived.clear()
            await self._arrived.wait()

    # -- stdin ---------------------------------------------------------------------------------
    async def _stdin_blocks(self) -> AsyncIterator[bytes]:
        while (block := await self._stdin.get()) is not None:
            yield block

    async def write(self, data: bytes | str) -> None:
        """Send ``data`` to the command's stdin (on a remote node, stdin goes when closed)."""
        if self._stdin_closed:
            raise UsageError("the spawned command's stdin is closed")
        self._stdin.put_nowait(data.encode() if isinstance(data, str) else bytes(data))

    async def close_stdin(self) -> None:
        """End the command's stdin (EOF)."""
        if not self._stdin_closed:
            self._stdin_closed = True
            self._stdin.put_nowait(None)

    # -- end -----------------------------------------------------------------------------------
    @property
    def returncode(self) -> int | None:
        """The exit code once the command has ended (``-9`` once killed), else None."""
        if not self._task.done():
            return None
        if self._task.cancelled():
            return -signal.SIGKILL
        return self._task.result().exit_code

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """The result once the command ends (``timeout``: `TimeoutError` after that many
        seconds, the command left running). Its stdout/stderr hold the last ``keep`` bytes
        of output, what `read` or iteration took included; a killed command's result has
        exit code ``-9`` and no output."""
        try:
            result = await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.CancelledError:
            if not self._task.cancelled():  # the caller itself is being cancelled
                raise
            result = ExecResult(-signal.SIGKILL, b"", b"", 0.0)
        self.result = result
        return result

    async def kill(self) -> None:
        """Kill the command in the sandbox (SIGKILL through its agent) and wait for it."""
        if not self._task.done():
            self._task.cancel()
        await self.wait()

    async def __aenter__(self) -> AsyncProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
