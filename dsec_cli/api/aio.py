"""The asyncio SDK: `AsyncSandbox`, the methods of `Sandbox` as coroutines, for trainers that
drive rollouts from an event loop.

    import asyncio
    from dsec_cli import AsyncSandbox

    async def rollout(i):
        async with await AsyncSandbox.create("busybox@1.35-1", "fncall") as sb:
            return (await sb.exec(f"echo {i}")).stdout

    print(asyncio.run(asyncio.gather(*(rollout(i) for i in range(100)))))

Nothing waits in a thread per sandbox: execs and file reads and writes of container and
fncall sandboxes go over asyncio connections to their agents, and a cluster node's
sandboxes over one asyncio ssh session per node; creates, removes, pauses, snapshots and
forks (no asyncio path: runtimes, mounts, cgroups) run on one shared executor of a bounded
number of threads (`dsec_cli.run.aio.EXECUTOR_THREADS`). Routing is `Sandbox`'s: a
``NODE/ID`` id or ``node=NAME`` is a cluster node, ``node="auto"`` is placed, else local.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Literal

from ..backends.base import ExecResult
from ..backends.sandbox_agent.aio import AsyncOutputCallback, AsyncStdin
from ..run.aio import AsyncNode, async_node, blocking, close_connections
from ..run.contract import NodeAPI
from ..run.fork import check_count
from ..run.node import local_node
from ..run.options import CreateOptions
from .options import new_sandbox_options
from .process import DEFAULT_KEEP, AsyncProcess
from .routing import target
from .sandboxes import Sandbox, _user_kw, exec_argv, refuse_key, removal_at_exit
from .sandboxes import create as create_sync

__all__ = ["AsyncSandbox", "ExecResult", "close_sessions"]


def _async(node: NodeAPI) -> Any:
    """The asyncio face of a node: `AsyncNode` here, `AsyncRemoteNode` for a cluster node."""
    from ..run.cluster.remote import RemoteNode

    if isinstance(node, RemoteNode):
        from ..run.cluster.aio import AsyncRemoteNode

        return AsyncRemoteNode(node.entry, node.timeout)
    return async_node(node)  # type: ignore[arg-type]


class AsyncSandbox:
    """A sandbox on this node or a cluster node, driven from asyncio. Make one with
    ``await AsyncSandbox.create(...)`` (or ``attach``); ``async with`` removes it on exit.
    Bound to the event loop that made it."""

    _rec: Any
    node: Any  # an AsyncNode or an AsyncRemoteNode

    def __init__(self, record: Any, node: Any) -> None:
        self._rec, self.node = record, node
        self._job: bool | None = None  # whether it is a job's sandbox (None: not known yet)
        self._finalizer: weakref.finalize | None = None

    @property
    def id(self) -> str:
        return str(self._rec.id)

    @property
    def backend(self) -> str:
        return str(self._rec.backend)

    @property
    def image(self) -> str:
        return str(self._rec.image)

    @property
    def status(self) -> str:
        return str(self._rec.status)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, image={self.image!r}, backend={self.backend!r})"

    @classmethod
    async def create(cls, image: str | Path, backend: str = "container", *,
                     cpus: float | None = None, memory: int | str | None = None,
                     pids: int | None = None, ttl: float | str | None = None,
                     network: Literal["none", "host", "allowlist"] = "none",
                     env: dict[str, str] | None = None, workdir: str | None = None,
                     state_dir: str | Path | None = None, store: str | None = None,
                     node: str | None = None, disk: int | str | None = None,
                     cpu_class: str | None = None, egress: list[str] | None = None,
                     user: str | None = None, remove_at_exit: bool = False) -> AsyncSandbox:
        """As ``Sandbox(image, backend, ...)``: every option is checked before anything is
        made. ``node``: a cluster node's name, ``"auto"``, or None/``"local"``.
        ``remove_at_exit``: removed when the object is collected or the interpreter exits
        (whichever is first), from any thread, without the event loop."""
        opts = new_sandbox_options(image, node, backend, cpus=cpus, memory=memory, pids=pids,
                                   ttl=ttl, network=network, env=env, workdir=workdir,
                                   disk=disk, cpu_class=cpu_class, user=user, egress=egress)
        sb = await cls._create(image, opts, node, state_dir, store)
        if remove_at_exit:
            sb._finalizer = removal_at_exit(sb, sb._sync().node, sb.id)
        return sb

    @classmethod
    async def _create(cls, image: str | Path, opts: CreateOptions, node: str | None,
                      state_dir: str | Path | None, store: str | None) -> AsyncSandbox:
        if node == "auto":  # placement asks every node: the threaded fan-out, awaited
            sync_node, rec = await blocking(create_sync, image, opts, node, state_dir, store)
            return cls(rec, _async(sync_node))
        an = _async(target(None, node, state_dir, store) if node and node != "local"
                    else local_node(state_dir, store))
        return cls(await an.create(str(image), opts), an)

    @classmethod
    async def attach(cls, sandbox_id: str, *,
                     state_dir: str | Path | None = None) -> AsyncSandbox:
        """The sandbox ``sandbox_id`` (``NODE/ID`` for a cluster node's)."""
        an = _async(target(sandbox_id, state_dir=state_dir))
        return cls(await an.lookup(sandbox_id), an)

    async def exec(self, cmd: str | list[str], *, stdin: AsyncStdin = None,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float | None = None, on_output: AsyncOutputCallback | None = None,
                   capture_limit: int | None = None, user: str | None = None,
                   key: str | None = None) -> ExecResult:
        """Run a command (a list, or a string for `sh -c`). ``stdin``: bytes, str, or an
        (async) iterable of bytes; ``on_output(stream, data)`` (a function or a coroutine
        function) gets output as it arrives. A failing command is a result, not an
        exception; cancelling the awaiting task kills the command. ``user`` (NAME, UID,
        NAME:GROUP, UID:GID) overrides the sandbox's user for this command (on this
        node's sandboxes).

        In a job's sandbox on this node the exec is a journaled step, as with `Sandbox`
        (its output comes once the step is committed); ``key`` then makes it run at most
        once (a retry is served from the journal)."""
        argv = exec_argv(cmd)
        if isinstance(self.node, AsyncNode) and \
                (self._job is not False or key is not None):
            res = await self._journaled(argv, key, stdin=stdin, env=env, cwd=cwd,
                                        timeout=timeout, on_output=on_output,
                                        capture_limit=capture_limit, user=user)
            if res is not None:
                return res
        refuse_key(key, "AsyncJob")
        extra = _user_kw(None if isinstance(self.node, AsyncNode) else self.node, user)
        return await self.node.exec(self.id, argv, env=env, cwd=cwd, stdin=stdin,
                                    timeout=timeout, on_output=on_output,
                                    capture_limit=capture_limit, **extra)

    async def spawn(self, cmd: str | list[str], *, env: dict[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None,
                    keep: int = DEFAULT_KEEP) -> AsyncProcess:
        """Start a command (a list, or a string for `sh -c`) and leave it running: the
        `AsyncProcess` keeps its output as it arrives (up to ``keep`` bytes) for `read`,
        iteration or `wait`, takes stdin with `write`, and ends it with `kill`."""
        _user_kw(None if isinstance(self.node, AsyncNode) else self.node, user)
        return AsyncProcess(self, exec_argv(cmd), env=env, cwd=cwd, user=user, keep=keep)

    async def _journaled(self, argv: list[str], key: str | None,
                         **kw: Any) -> ExecResult | None:
        """The exec as a journaled step if the sandbox is a job's (learnt once: a sandbox
        is a job's from its creation on)."""
        from .aio_jobs import journaled_exec

        node = self.node.node
        if not (node.root / "jobs.db").exists():
            self._job = False
            return None
        res = await journaled_exec(node, self.id, argv, key=key, **kw)
        self._job = res is not None
        return res

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, *,
                         user: str | None = None) -> None:
        """As `Sandbox.write_file`: as the sandbox's user, or ``user`` (this node's
        sandboxes; a cluster node refuses it); the directories made are theirs."""
        await self.node.put_file(self.id, path,
                                 data.encode() if isinstance(data, str) else data, mode, user)

    async def read_file(self, path: str, *, user: str | None = None) -> bytes:
        """As `Sandbox.read_file`: as the sandbox's user, or ``user``."""
        return bytes(await self.node.get_file(self.id, path, user))

    async def copy_in(self, src: str | Path, dst: str) -> dict[str, Any]:
        """Copy a host file into the sandbox at ``dst`` (as `dsec cp SRC ID:DST`)."""
        return dict(await self.node.copy(str(src), f"{self.id}:{dst}"))

    async def copy_out(self, src: str, dst: str | Path) -> dict[str, Any]:
        """Copy a file, symlink or directory out of the sandbox to host path ``dst``."""
        return dict(await self.node.copy(f"{self.id}:{src}", str(dst)))

    async def pause(self) -> None:
        self._rec = await self.node.pause(self.id)

    async def resume(self) -> None:
        self._rec = await self.node.resume(self.id)

    async def snapshot(self, ref: str, push: str | None = None, *, replace: bool = False
                       ) -> dict[str, Any]:
        return dict(await self.node.snapshot(self.id, ref, push, replace=replace))

    async def fork(self, n: int) -> list[AsyncSandbox]:
        """As `Sandbox.fork`: ``n`` copies of this sandbox's files, on its node."""
        out = await self.node.fork(self.id, check_count(n))
        return [AsyncSandbox(r, self.node) for r in out["copies"]]

    async def info(self) -> dict[str, Any]:
        return dict(await self.node.describe(self.id))

    # -- density and the grader plane: the sync methods, on the shared executor -------------
    def _sync(self) -> Sandbox:
        """This sandbox seen through the thread API (the same node, the same id)."""
        from ..run.cluster.remote import RemoteNode

        node = self.node.node if isinstance(self.node, AsyncNode) else \
            RemoteNode(self.node.entry, self.node.timeout)
        return Sandbox._wrap(self._rec, node)

    async def park(self) -> dict[str, Any]:
        """As `Sandbox.park`: stopped, its memory given back."""
        out = dict(await blocking(self._sync().park))
        self._rec = await self.node.lookup(self.id)
        return out

    async def thaw(self, prefetch: bool = False, to: str | None = None) -> dict[str, Any]:
        """As `Sandbox.thaw`: with ``to``, a parked VM moves to that node first (this
        object then names it there)."""
        sync = self._sync()
        out = dict(await blocking(sync.thaw, prefetch, to))
        if to is not None:
            self.node = _async(sync.node)
        self._rec = await self.node.lookup(sync.id)
        return out

    async def set_egress(self, rules: list[str]) -> dict[str, Any]:
        """As `Sandbox.set_egress`."""
        return dict(await blocking(self._sync().set_egress, list(rules)))

    async def start_task(self) -> dict[str, Any]:
        """As `Sandbox.start_task`."""
        return dict(await blocking(self._sync().start_task))

    async def grade(self, grader: str, **options: Any) -> Any:
        """As `Sandbox.grade`: scored in a fork, the agent's sandbox untouched."""
        return await blocking(lambda: self._sync().grade(grader, **options))

    async def remove(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        await self.node.remove(self.id)

    close = remove

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.remove()


async def close_sessions() -> None:
    """Close the running loop's agent connections and cluster sessions (the ssh processes
    exit). Call it before the loop ends, as `asyncio.run` does not wait for them."""
    from ..run.cluster.aio import close_channels

    await close_connections()
    await close_channels()
