"""SWE-ReX on dsec: `DsecDeployment` (an `AbstractDeployment`: start makes a sandbox, stop
removes it) and `DsecRuntime` (an `AbstractRuntime` over an `AsyncSandbox`), so SWE-agent
runs its shell sessions, commands and file operations in a dsec sandbox.

    deployment = DsecDeployment(image="swe-task@1", backend="container")
    await deployment.start()
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    await rt.run_in_session(BashAction(command="cd /testbed && ls", timeout=30))
    await deployment.stop()

A session is one long-running shell in the sandbox (bash where the image has it, else sh),
fed commands on its stdin through the sandbox's agent connection, its stdout and stderr
merged; each command is followed by a marker that carries its exit code. No server needs to
be installed in the image.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import re
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NoExitCodeError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from ..api.aio import AsyncSandbox
from ..api.sandboxes import Sandbox
from ..core.errors import DsecError

__all__ = ["DsecDeployment", "DsecDeploymentConfig", "DsecRuntime"]

log = logging.getLogger(__name__)

_MERGE = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]
# the session's shell: bash without its start-up files where the image has it, else sh
# the marker of a command interrupted earlier, dropped from the output that follows it
_STALE = re.compile(r"__DSEC_[0-9a-f]{32}__\d+__DSEC_[0-9a-f]{32}__")
_SHELL = 'if command -v bash >/dev/null 2>&1; then exec bash --norc --noprofile; fi; exec sh'


class _Session:
    """One shell process in the sandbox, driven through its stdin; its output is read into
    a buffer that each command's marker splits."""

    def __init__(self, sandbox: AsyncSandbox, request: CreateBashSessionRequest) -> None:
        self.sandbox, self.request = sandbox, request
        self._stdin: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._buf = ""
        self._changed = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self.pid = 0

    async def _feed(self) -> AsyncIterator[bytes]:
        while (data := await self._stdin.get()) is not None:
            yield data

    def _out(self, stream: str, data: bytes) -> None:
        self._buf += data.decode("utf-8", errors="backslashreplace")
        self._changed.set()

    async def start(self) -> CreateBashSessionResponse:
        self._task = asyncio.ensure_future(self.sandbox.exec(
            [*_MERGE, "/bin/sh", "-c", _SHELL], stdin=self._feed(), on_output=self._out))
        sources = "".join(f". {p}\n" for p in self.request.startup_source)
        out, _, _ = await self._send(f"{sources}echo $$", self.request.startup_timeout + 10)
        lines = out.rstrip("\n").rsplit("\n", 1)
        self.pid = int(lines[-1])
        return CreateBashSessionResponse(output=lines[0] if len(lines) > 1 else "")

    async def _send(self, command: str, timeout: float | None,
                    expect: list[str] | None = None) -> tuple[str, int | None, str]:
        """Write ``command`` and a marker; wait for the marker (or one of ``expect``) in
        the output. Returns the output before it, the exit code and what matched."""
        mark = f"__DSEC_{uuid.uuid4().hex}__"
        self._stdin.put_nowait(f"{command}\nprintf '{mark}%s{mark}' \"$?\"\n".encode())
        return await self._wait(command, timeout, expect or [], mark)

    async def _wait(self, command: str, timeout: float | None, expect: list[str],
                    mark: str | None = None) -> tuple[str, int | None, str]:
        done = re.compile(re.escape(mark) + r"(\d+)" + re.escape(mark)) if mark else None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if done and (m := done.search(self._buf)):
                out, self._buf = self._buf[:m.start()], self._buf[m.end():]
                return _STALE.sub("", out), int(m.group(1)), ""
            for e in expect:
                if (i := self._buf.find(e)) >= 0:
                    out, self._buf = self._buf[:i], self._buf[i + len(e):]
                    return _STALE.sub("", out), None, e
            if self._task is not None and self._task.done():
                raise NoExitCodeError(f"the session's shell exited while running {command!r}"
                                      f"; its output:\n{self._buf}")
            self._changed.clear()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise CommandTimeoutError(f"timeout after {timeout} seconds while running "
                                          f"command {command!r}")
            try:
                await asyncio.wait_for(self._changed.wait(), None if left is None
                                       else min(left, 1.0))
            except TimeoutError:
                pass

    async def run(self, action: BashAction | BashInterruptAction) -> BashObservation:
        if isinstance(action, BashInterruptAction):
            return await self.interrupt(action)
        if action.is_interactive_command or action.is_interactive_quit:
            self._stdin.put_nowait(f"{action.command}\n".encode())  # no marker: the
            # program reads its stdin, so only what it prints can end the wait
            out, _, matched = await self._wait(action.command, action.timeout, action.expect)
            return BashObservation(output=out, exit_code=0, expect_string=matched)
        check = await self.sandbox.exec(["/bin/sh", "-n", "-c", action.command])
        if check.exit_code != 0:  # a syntax error would end the session's shell
            err = check.stderr.decode(errors="backslashreplace")
            raise BashIncorrectSyntaxError(
                f"Error (exit code {check.exit_code}) while checking bash command \n"
                f"{action.command!r}\n---- Stderr ----\n{err}",
                extra_info={"bash_stdout": "", "bash_stderr": err})
        out, code, matched = await self._send(action.command, action.timeout, action.expect)
        if action.check == "ignore":
            code = None
        elif action.check == "raise" and code != 0:
            msg = (f"Command {action.command!r} failed with exit code {code}. "
                   f"Here is the output:\n{out!r}")
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=out, exit_code=code, expect_string=matched)

    async def interrupt(self, action: BashInterruptAction) -> BashObservation:
        """SIGINT, then SIGKILL, to what the session's shell is running (its descendants),
        then the output up to the marker of the interrupted command."""
        kill = (f"kids() {{ for s in /proc/[0-9]*/stat; do read -r p _ _ pp _ < $s 2>/dev/null"
                f" && [ \"$pp\" = \"$1\" ] && echo $p && kids $p; done; }}; "
                f"for p in $(kids {self.pid}); do kill -$0 $p 2>/dev/null; done")
        for sig in ["INT"] * action.n_retry + ["KILL"]:
            await self.sandbox.exec(["/bin/sh", "-c", kill, sig])
            try:
                out, _, matched = await self._send("", action.timeout, action.expect)
            except CommandTimeoutError:
                continue
            return BashObservation(output=out.strip(), exit_code=0, expect_string=matched)
        raise CommandTimeoutError("failed to interrupt session")

    async def close(self) -> CloseBashSessionResponse:
        self._stdin.put_nowait(None)  # end of stdin: the shell exits
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 5)
            except Exception:  # the shell ignored EOF, or its sandbox is gone
                self._task.cancel()
        return CloseBashSessionResponse()


class DsecRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface on one dsec sandbox (which it does not own)."""

    def __init__(self, sandbox: AsyncSandbox, *, logger: logging.Logger | None = None
                 ) -> None:
        self.sandbox = sandbox
        self.logger = logger or log
        self.sessions: dict[str, _Session] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await asyncio.wait_for(self.sandbox.info(), timeout)
        except Exception as e:
            return IsAliveResponse(is_alive=False, message=str(e))
        running = info.get("status") == "running"
        return IsAliveResponse(is_alive=running,
                               message="" if running else f"sandbox is {info.get('status')}")

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self.sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        session = _Session(self.sandbox, request)
        self.sessions[request.session] = session
        return await session.start()

    def _session(self, name: str) -> _Session:
        if name not in self.sessions:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return self.sessions[name]

    async def run_in_session(self, action: Action) -> Observation:
        return await self._session(action.session).run(action)

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        out = await self._session(request.session).close()
        del self.sessions[request.session]
        return out

    async def execute(self, command: Command) -> CommandResponse:
        """A command in a fresh process, as `subprocess.run` (``shell``, ``cwd``, ``env``,
        ``timeout``, ``check``, ``merge_output_streams``)."""
        argv = ["/bin/sh", "-c", command.command] if command.shell and \
            isinstance(command.command, str) else \
            [command.command] if isinstance(command.command, str) else list(command.command)
        if command.merge_output_streams:
            argv = [*_MERGE, *argv]
        r = await self.sandbox.exec(argv, cwd=command.cwd, env=command.env,
                                    timeout=command.timeout)
        if r.timed_out:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command")
        resp = CommandResponse(stdout=r.stdout.decode(errors="backslashreplace"),
                               stderr=r.stderr.decode(errors="backslashreplace"),
                               exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{resp.stdout!r}\nStderr:\n{resp.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg
                                       else msg)
        return resp

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        data = await self.sandbox.read_file(request.path)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8",
                                                    request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await self.sandbox.write_file(request.path, request.content)
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A host file, or a directory tree (file by file, modes kept), into the sandbox."""
        src = Path(request.source_path)
        if not src.is_dir():
            await self.sandbox.copy_in(src, request.target_path)
            return UploadResponse()
        for root, _dirs, files in os.walk(src):
            for name in files:
                path = Path(root) / name
                dst = f"{request.target_path}/{path.relative_to(src).as_posix()}"
                await self.sandbox.write_file(dst, path.read_bytes(), path.stat().st_mode & 0o777)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        for name in list(self.sessions):
            await self.close_session(CloseBashSessionRequest(session=name))
        return CloseResponse()


class DsecDeploymentConfig(BaseModel):
    """A dsec sandbox as a SWE-ReX deployment."""

    image: str
    backend: str = "container"
    cpus: float | None = None
    memory: str | None = None
    pids: int | None = None
    network: Literal["none", "host", "allowlist"] = "none"
    ttl: str | None = "2h"
    """The node removes the sandbox after this even if the process driving it died."""
    node: str | None = None
    workdir: str | None = None
    type: Literal["dsec"] = "dsec"

    def get_deployment(self) -> DsecDeployment:
        return DsecDeployment(**self.model_dump(exclude={"type"}))


class DsecDeployment(AbstractDeployment):
    """Makes a dsec sandbox on `start` and removes it on `stop`."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = DsecDeploymentConfig(**kwargs)
        self.logger = logger or log
        self._hooks = CombinedDeploymentHook()
        self._runtime: DsecRuntime | None = None
        self.sandbox: AsyncSandbox | None = None

    @classmethod
    def from_config(cls, config: DsecDeploymentConfig) -> DsecDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        c = self._config
        self._hooks.on_custom_step("Starting dsec sandbox")
        self.sandbox = await AsyncSandbox.create(
            c.image, c.backend, cpus=c.cpus, memory=c.memory, pids=c.pids, network=c.network,
            ttl=c.ttl, node=c.node, workdir=c.workdir)
        self.logger.info("started sandbox %s", self.sandbox.id)
        self._runtime = DsecRuntime(self.sandbox, logger=self.logger)
        _started.add(self)

    async def stop(self) -> None:
        sb, rt = self.sandbox, self._runtime
        self.sandbox = self._runtime = None
        if rt is not None:
            await rt.close()
        if sb is not None:
            await sb.remove()

    @property
    def runtime(self) -> DsecRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime


_started: weakref.WeakSet[DsecDeployment] = weakref.WeakSet()


@atexit.register
def _remove_at_exit() -> None:
    """Deployments never stopped when the interpreter exits (their event loop is gone):
    their sandboxes are removed through the thread API."""
    for dep in list(_started):
        sb, dep.sandbox, dep._runtime = dep.sandbox, None, None
        if sb is not None:
            with contextlib.suppress(DsecError):
                Sandbox.attach(sb.id).remove()
