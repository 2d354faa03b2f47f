"""inspect-ai's `SandboxEnvironment` on dsec sandboxes: ``inspect eval task.py --sandbox dsec``.

Registered through inspect's ``inspect_ai`` entry point (the ``inspect`` extra), so a task
names it as ``sandbox="dsec"`` or ``sandbox=("dsec", "dsec.yaml")``. Each sample gets one
sandbox per service, created at sample setup and removed at sample cleanup; a sandbox still
there when the eval process ends (a crash, an interrupt) is removed at interpreter exit, and
a ``ttl`` in the config bounds it even past a killed process.

The config is a dsec config (``image``, ``backend``, ``memory``, ``cpus``, ``network``,
``egress``, ``user``, ``workdir``, ``env``, ``ttl``) or a compose-style file whose services
use compose's names for them (``image``, ``mem_limit``, ``cpus``, ``network_mode``,
``user``, ``working_dir``, ``environment``); see docs/integrations.md.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import stat
import uuid
from pathlib import Path
from typing import Any, Literal, overload

import yaml
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel, Field

from .. import AsyncSandbox, DsecError, UsageError
from ..api.aio_jobs import AsyncJob, AsyncRollout
from ..api.jobs import list_jobs
from . import rollout_sandbox

__all__ = ["DsecSandboxEnvironment", "DsecSandboxConfig", "DsecServiceConfig", "load_config"]

log = logging.getLogger(__name__)

#: the config files inspect looks for beside a task when ``--sandbox dsec`` names none
CONFIG_FILES = ["dsec.yaml", "dsec.yml"]
#: what a command gets when the config names no image (else the config must)
IMAGE_VARIABLE = "DSEC_INSPECT_IMAGE"


class DsecServiceConfig(BaseModel, frozen=True):
    """One sandbox of a sample: the options of `AsyncSandbox.create`."""

    image: str
    backend: str = "container"
    memory: str | int | None = None
    cpus: float | None = None
    pids: int | None = None
    network: Literal["none", "host", "allowlist"] = "none"
    egress: list[str] = Field(default_factory=list)
    user: str | None = None
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    ttl: str | float | None = None
    node: str | None = None


class DsecSandboxConfig(BaseModel, frozen=True):
    """The sandboxes of each sample, by service name; the first is inspect's default.
    ``lease`` and ``reclaim_grace`` set the task's dsec job: its sandboxes are removed once
    the lease has lapsed for that long (an eval killed before its cleanup)."""

    services: dict[str, DsecServiceConfig]
    lease: str | float = "60s"
    reclaim_grace: str | float = "2m"


#: compose's names for the options dsec takes
_COMPOSE = {"mem_limit": "memory", "working_dir": "workdir", "environment": "env",
            "network_mode": "network", "pids_limit": "pids"}
#: compose keys that change nothing in a dsec sandbox (processes, init and stop are its own)
_COMPOSE_IGNORED = {"command", "init", "stop_grace_period", "entrypoint", "tty",
                    "stdin_open", "x-default", "x-local", "restart", "hostname"}


def _service(doc: dict[str, Any], where: str) -> DsecServiceConfig:
    opts: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _COMPOSE_IGNORED:
            continue
        name = _COMPOSE.get(key, key)
        if name == "env" and isinstance(value, list):  # compose's ["K=V", ...]
            value = dict(str(v).partition("=")[::2] for v in value)
        if name == "network" and value == "bridge":
            value = "host"  # a compose network with a way out: dsec's host network
        opts[name] = value
    opts.setdefault("image", os.environ.get(IMAGE_VARIABLE, ""))
    if not opts["image"]:
        raise UsageError(f"{where}: no image", hint=f"name one, or set {IMAGE_VARIABLE}")
    try:
        return DsecServiceConfig(**opts)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from e


def load_config(config: SandboxEnvironmentConfigType | None) -> DsecSandboxConfig:
    """The sandboxes a sample gets from inspect's sandbox config: None (the image of
    $DSEC_INSPECT_IMAGE), a config model, or a YAML file (dsec keys, or compose services)."""
    if isinstance(config, DsecSandboxConfig):
        return config
    if isinstance(config, DsecServiceConfig):
        return DsecSandboxConfig(services={"default": config})
    if config is None:
        return DsecSandboxConfig(services={"default": _service({}, "sandbox dsec")})
    if not isinstance(config, str):
        raise UsageError(f"sandbox dsec takes a YAML file or a DsecSandboxConfig, not "
                         f"{type(config).__name__}")
    try:
        doc = yaml.safe_load(Path(config).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"cannot read sandbox config {config}: {e}") from e
    if not isinstance(doc, dict):
        raise UsageError(f"{config}: a sandbox config is a mapping")
    lease = {k: doc.pop(k) for k in _LEASE_KEYS if k in doc}
    services = doc.get("services")
    if services is None:
        services = {"default": _service(doc, config)}
    elif not isinstance(services, dict) or not services:
        raise UsageError(f"{config}: services is a mapping of at least one service")
    else:
        services = {name: _service(dict(svc or {}), f"{config}: service {name}")
                    for name, svc in services.items()}
    try:
        return DsecSandboxConfig(services=services, **lease)
    except ValueError as e:
        raise UsageError(f"{config}: {e}") from e


#: the config's keys that set the task's job, beside its services
_LEASE_KEYS = ("lease", "reclaim_grace")


@sandboxenv(name="dsec")
class DsecSandboxEnvironment(SandboxEnvironment):
    """One dsec sandbox as an inspect sandbox environment."""

    #: the job of each sandbox config the running eval started (inspect calls task_init
    #: and task_cleanup once per config, not per task): the lease its samples hang on
    _jobs: dict[str, AsyncJob] = {}

    def __init__(self, sandbox: AsyncSandbox, workdir: str,
                 rollout: AsyncRollout | None = None) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.workdir = workdir
        self.rollout = rollout

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def config_files(cls) -> list[str]:
        return list(CONFIG_FILES)

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return DsecSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None
                        ) -> None:
        """The config's dsec job: its heartbeat holds the lease while the eval runs; if the
        eval dies, the samples' sandboxes are removed once the lease has lapsed."""
        key = _config_key(config)
        if key in cls._jobs:
            return
        cfg = load_config(config)
        cls._jobs[key] = await AsyncJob.start(
            f"inspect-{uuid.uuid4().hex[:12]}", ttl=cfg.lease,
            # an eval does not come back for its samples: nothing is parked for it
            park_grace=cfg.reclaim_grace, reclaim_grace=cfg.reclaim_grace)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        """End the task's job: with ``cleanup`` everything of it is removed; without
        (``--no-sandbox-cleanup``) its sandboxes stay until the lease lapses."""
        job = cls._jobs.pop(_config_key(config), None)
        if job is None:
            return
        if cleanup:
            await job.remove()
        else:
            await job.close()

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """`inspect sandbox cleanup dsec [ID]`: one sandbox, or every inspect job's."""
        if id is not None:
            await (await AsyncSandbox.attach(id)).remove()
            return
        for name in await asyncio.to_thread(_inspect_jobs):
            await (await AsyncJob.attach(name, heartbeat=False)).remove()

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        cfg = load_config(config)
        job = cls._jobs.get(_config_key(config))
        envs: dict[str, SandboxEnvironment] = {}
        try:
            for name, svc in cfg.services.items():
                envs[name] = await cls._start(svc, job)
        except BaseException:
            await cls._remove(envs)
            raise
        return envs

    @classmethod
    async def _start(cls, svc: DsecServiceConfig,
                     job: AsyncJob | None = None) -> DsecSandboxEnvironment:
        opts: dict[str, Any] = dict(
            memory=svc.memory, cpus=svc.cpus, pids=svc.pids, network=svc.network,
            egress=svc.egress or None, user=svc.user, workdir=svc.workdir,
            env=svc.env or None, ttl=svc.ttl)
        rollout = None
        if job is not None and svc.node is None:
            rollout = await job.sandbox(svc.image, svc.backend, **opts)
            sb = await rollout_sandbox(rollout)
        else:  # no task job (a sandbox made outside an eval), or a named cluster node
            sb = await AsyncSandbox.create(svc.image, svc.backend, node=svc.node,
                                           remove_at_exit=True, **opts)
        try:
            workdir = str((await sb.info()).get("workdir") or "/")
            if svc.workdir and svc.user:
                # compose's working_dir for a user: the directory is there and theirs
                await _run(sb, ["mkdir", "-p", workdir], user="0")
                await _run(sb, ["chown", svc.user, workdir], user="0")
        except BaseException:
            await _end(sb, rollout)
            raise
        return cls(sb, workdir, rollout)

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment],
                             interrupted: bool) -> None:
        await cls._remove(environments)

    @classmethod
    async def _remove(cls, environments: dict[str, SandboxEnvironment]) -> None:
        for env in environments.values():
            if isinstance(env, DsecSandboxEnvironment):
                try:
                    await _end(env.sandbox, env.rollout)
                except DsecError as e:
                    log.warning("could not remove sandbox %s: %s", env.sandbox.id, e)

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        return SandboxConnection(type="dsec", command=f"dsec exec {self.sandbox.id} -- /bin/sh")

    # -- work inside -------------------------------------------------------------------------
    def _path(self, path: str) -> str:
        return posixpath.join(self.workdir, path)

    async def exec(self, cmd: list[str], input: str | bytes | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None,
                   user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        try:
            r = await _run(self.sandbox, list(cmd), stdin=input, env=env,
                           cwd=self._path(cwd or "."), user=user, timeout=timeout,
                           capture_limit=limit)
        except UsageError as e:
            if user is None:
                raise
            return ExecResult(False, 1, "", f"cannot run as user {user}: {e}\n")
        if r.timed_out:
            raise TimeoutError(f"command timed out after {timeout}s: {cmd}")
        stdout = r.stdout.decode(errors="replace")
        stderr = r.stderr.decode(errors="replace")
        if r.stdout_truncated or r.stderr_truncated:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                                           stdout if r.stdout_truncated else stderr)
        if r.exit_code == 126 and "cannot execute" in stderr and "Permission denied" in stderr:
            raise PermissionError(errno.EACCES, stderr.strip(), cmd[0])
        return ExecResult(r.exit_code == 0, r.exit_code, stdout, stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode() if isinstance(contents, str) else contents
        try:
            await self.sandbox.write_file(self._path(file), data)
        except DsecError as e:
            raise _os_error(e, file) from e

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        try:
            data, mode = await self.sandbox.node.get_file_with_mode(self.sandbox.id,
                                                                    self._path(file))
        except DsecError as e:
            raise _os_error(e, file) from e
        if not mode & stat.S_IRUSR:
            # docker's provider refuses a file its owner may not read, even to root (its
            # archive copy is read as root), and inspect's checks expect that of every provider
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), file)
        if len(data) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR,
                                           None)
        return data.decode() if text else data


def _os_error(e: DsecError, file: str) -> Exception:
    """The `OSError` subclass inspect expects (FileNotFoundError, PermissionError,
    IsADirectoryError...) for a file error from the sandbox; others pass as they are."""
    if e.errno is None:
        return e
    return OSError(e.errno, os.strerror(e.errno), file)


def _inspect_jobs() -> list[str]:
    """The names of this node's jobs that inspect tasks started."""
    return [j["name"] for j in list_jobs() if str(j["name"]).startswith("inspect-")]


def _config_key(config: SandboxEnvironmentConfigType | None) -> str:
    """What identifies a sandbox config across inspect's task_init, sample_init and
    task_cleanup calls: the file's path, or the model's fields."""
    if isinstance(config, BaseModel):
        return type(config).__name__ + config.model_dump_json()
    return repr(config)


async def _run(sb: AsyncSandbox, argv: list[str], *, user: str | None = None,
               stdin: str | bytes | None = None, **kw: Any) -> Any:
    """A command in the sandbox through its node, not as a journaled step of the config's
    job: inspect reruns a sample from its start, so its commands need no journal (and a
    step would not take ``user=``)."""
    if user is not None:
        kw["user"] = user
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return await sb.node.exec(sb.id, argv, stdin=data, **kw)


async def _end(sb: AsyncSandbox, rollout: AsyncRollout | None) -> None:
    """A sample's sandbox gone: released from the config's job, or removed."""
    await (rollout.release() if rollout is not None else sb.remove())
