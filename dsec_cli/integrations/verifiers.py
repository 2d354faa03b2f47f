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
from ..api.process import AsyncProcess
from ..api.sandboxes import Sandbox
from ..core.errors import DsecError
from . import rollout_sandbox

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
    """A command running in the sandbox with its stdin open: dsec's `AsyncProcess`, its two
    streams read apart."""

    def __init__(self, proc: AsyncProcess) -> None:
        self._proc = proc
        self.stdout, self.stderr = proc.stream("stdout"), proc.stream("stderr")

    async def write(self, data: bytes) -> None:
        await self._proc.write(data)

    async def wait(self) -> int:
        return (await self._proc.wait()).exit_code

    async def poll(self) -> int | None:
        return self._proc.returncode

    async def terminate(self) -> None:
        await self._proc.kill()

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
            self.sandbox = await rollout_sandbox(self.rollout)
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
        return _Process(await self._box().spawn(list(argv), env=self.process_env(env)))

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
