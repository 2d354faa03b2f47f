"""verifiers (``verifiers.v1``) on dsec: `DsecRuntime`, a verifiers `Runtime` whose box is a
dsec sandbox driven through `AsyncSandbox`, optionally leased to a trainer's `AsyncJob` so a
rollout's sandbox is one of the job's (its execs journaled, its slot under the job's cap).

    runtime = make_runtime(DsecConfig(image="task@1"), job=job)   # job: an AsyncJob or None
    await runtime.start()
    r = await runtime.run(["sh", "-c", "make test"], {})          # a ProgramResult
    await runtime.stop()

Everything else (`run_program`, capped `read`, `with_env`, `alive`, the interpreter-exit
backstop) is verifiers' own code over these methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic_config import BaseConfig
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import (
    BaseRuntimeInfo,
    ProgramResult,
    Runtime,
    RuntimeProcess,
    register,
)

from ..api.aio import AsyncSandbox
from ..api.aio_jobs import AsyncJob, AsyncRollout
from ..api.sandboxes import Sandbox
from ..core.errors import DsecError

__all__ = ["DsecConfig", "DsecRuntime", "DsecRuntimeInfo", "make_runtime"]


class DsecConfig(BaseConfig):
    type: Literal["dsec"] = "dsec"
    image: str
    backend: str = "container"
    cpus: float | None = None
    memory: str | None = None
    pids: int | None = None
    network: Literal["none", "host", "allowlist"] = "none"
    ttl: str | None = "2h"
    workdir: str | None = None
    node: str | None = None


class DsecRuntimeInfo(DsecConfig, BaseRuntimeInfo):
    pass


class _Process(RuntimeProcess):
    """A command running in the sandbox with its stdin open: an exec fed from a queue, its
    output put on two more."""

    def __init__(self, sandbox: AsyncSandbox, argv: list[str], env: dict[str, str]) -> None:
        self._stdin: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._out: dict[str, asyncio.Queue[bytes | None]] = {
            "stdout": asyncio.Queue(), "stderr": asyncio.Queue()}
        self.stdout, self.stderr = self._drain("stdout"), self._drain("stderr")
        self._task = asyncio.ensure_future(sandbox.exec(
            argv, env=env, stdin=self._feed(), on_output=lambda s, d: self._out[s].put_nowait(d)))
        self._task.add_done_callback(self._ended)

    def _ended(self, _task: asyncio.Task[Any]) -> None:
        for q in self._out.values():
            q.put_nowait(None)  # end of both streams

    async def _feed(self) -> AsyncIterator[bytes]:
        while (data := await self._stdin.get()) is not None:
            yield data

    async def _drain(self, stream: str) -> AsyncIterator[bytes]:
        while (data := await self._out[stream].get()) is not None:
            yield data

    async def write(self, data: bytes) -> None:
        self._stdin.put_nowait(data)

    async def wait(self) -> int:
        try:
            return (await asyncio.shield(self._task)).exit_code
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise
            return -9

    async def poll(self) -> int | None:
        if not self._task.done():
            return None
        return -9 if self._task.cancelled() else self._task.result().exit_code

    async def terminate(self) -> None:
        self._task.cancel()  # cancelling an exec kills its command in the sandbox

    kill = terminate


class DsecRuntime(Runtime):
    """A verifiers runtime on one dsec sandbox; with ``job``, the sandbox is the job's."""

    def __init__(self, config: DsecConfig, name: str | None = None, *,
                 job: AsyncJob | None = None) -> None:
        super().__init__(name)
        self.config = config
        self.info = DsecRuntimeInfo(**config.model_dump())
        self.job = job
        self.rollout: AsyncRollout | None = None
        self.sandbox: AsyncSandbox | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        c = self.config
        opts: dict[str, Any] = dict(cpus=c.cpus, memory=c.memory, pids=c.pids,
                                    network=c.network, ttl=c.ttl, workdir=c.workdir)
        if self.job is not None:
            self.rollout = await self.job.sandbox(c.image, c.backend, **opts)
            sid = str(self.rollout.sandbox_id)
            if self.rollout.node and "/" not in sid:  # a cluster node's: NODE/ID
                sid = f"{self.rollout.node}/{sid}"
            self.sandbox = await AsyncSandbox.attach(sid)
        else:
            self.sandbox = await AsyncSandbox.create(c.image, c.backend, node=c.node, **opts)
        self.info.id = self.sandbox.id

    def _box(self) -> AsyncSandbox:
        if self.sandbox is None:
            raise SandboxError(f"runtime {self.name} is not started")
        return self.sandbox

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        try:
            r = await self._box().exec(list(argv), env=self.process_env(env))
        except DsecError as e:
            raise SandboxError(f"run {argv[:1]!r}: {e}") from e
        return ProgramResult(exit_code=r.exit_code,
                             stdout=r.stdout.decode(errors="replace"),
                             stderr=r.stderr.decode(errors="replace"))

    async def open_process(self, argv: list[str], env: dict[str, str]) -> RuntimeProcess:
        return _Process(self._box(), list(argv), self.process_env(env))

    async def run_background(self, argv: list[str], env: dict[str, str], log: str) -> None:
        """``argv`` with its output to ``log``, running until `stop` (its exec is a task of
        the loop; cancelling it kills the command)."""
        wrapped = ["/bin/sh", "-c", 'log=$1; shift; exec "$@" >"$log" 2>&1', "sh", log, *argv]
        self._tasks.append(asyncio.ensure_future(
            self._box().exec(wrapped, env=self.process_env(env))))

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        try:
            data = await self._box().read_file(path)
        except DsecError as e:
            raise SandboxError(f"read {path!r}: {e}") from e
        return data if max_bytes is None else data[:max_bytes]

    async def write(self, path: str, data: bytes) -> None:
        try:
            await self._box().write_file(path, data)
        except DsecError as e:
            raise SandboxError(f"write {path!r}: {e}") from e

    async def teardown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        if self.rollout is not None:
            await self.rollout.release()  # the slot goes back to the job; its journal stays
        elif self.sandbox is not None:
            await self.sandbox.remove()
        self.sandbox = self.rollout = None

    def cleanup(self) -> None:
        """The interpreter-exit backstop (no event loop): remove the sandbox if it is
        still there."""
        if self.sandbox is None:
            return
        sid, self.sandbox = self.sandbox.id, None
        with contextlib.suppress(DsecError):
            Sandbox.attach(sid).remove()


def make_runtime(config: DsecConfig, name: str | None = None, *,
                 job: AsyncJob | None = None) -> DsecRuntime:
    """A `DsecRuntime` registered with verifiers' interpreter-exit backstop, as
    `verifiers.v1.runtimes.make_runtime` registers its own."""
    runtime = DsecRuntime(config, name, job=job)
    register(runtime)
    return runtime
