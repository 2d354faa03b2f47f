"""Jobs driven from asyncio: `AsyncJob`, `AsyncRollout` and `AsyncGroup`, the methods of
`Job`, `Rollout` and `Group` (api/jobs.py) as coroutines.

    from dsec_cli.api.aio_jobs import AsyncJob

    async def train():
        async with await AsyncJob.start("train-42", ttl="60s") as job:
            group = await job.group(8, "task@1", backend="container")
            rs = await asyncio.gather(*(m.rollout.exec("make test", key="turn-1")
                                        for m in group.ok()))

A journaled step waits in the event loop, not in a thread: the journal's writes before and
after the command (short sqlite transactions) run on the shared bounded executor of
run/aio.py, and the command itself goes over the loop's connection to the sandbox's agent
(a cluster node's rollouts: over the loop's session to the node, whose node service
journals them). The lease's heartbeat is a task of the loop, cancelled by `close`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..backends.base import ExecResult
from ..core.errors import DsecError
from ..run.aio import _whole, async_node, blocking, executor
from ..run.jobs import NodeJobs, Step, StepRunning, check_name, node_jobs
from ..run.node import Node
from ..run.options import CreateOptions
from .jobs import (
    _admit,
    _beat_every,
    _beat_failed,
    _check_written,
    _doc_settings,
    _group_plan,
    _GroupMembers,
    _is_lost,
    _jobs,
    _live_sandbox,
    _MemberState,
    _RolloutDoc,
    _SlotWait,
    _step,
    _wanted,
    _write_step,
    refuse_step_user,
    settings,
    step_output,
)
from .options import create_options, secs

__all__ = ["AsyncJob", "AsyncRollout", "AsyncGroup", "AsyncMember", "journaled_exec"]

log = logging.getLogger(__name__)


class AsyncJobs(Protocol):
    """A node's jobs as `AsyncJob` and `AsyncRollout` use them: `LocalJobs` (this node) and
    `RemoteJobs` (a cluster node), the methods of `NodeJobs` as coroutines, by keyword."""

    name: Any

    async def start(self, *, name: str, settings: dict[str, Any] | None = None,
                    exist_ok: bool = True) -> dict[str, Any]: ...
    async def reattach(self, *, name: str) -> dict[str, Any]: ...
    async def renew(self, *, name: str, ttl: float | None = None) -> dict[str, Any]: ...
    async def park(self, *, name: str) -> dict[str, Any]: ...
    async def thaw(self, *, name: str, prefetch: bool = False) -> dict[str, Any]: ...
    async def remove(self, *, name: str) -> dict[str, Any]: ...
    async def rollout(self, *, rid: str) -> dict[str, Any]: ...
    async def rollouts(self, *, name: str) -> list[dict[str, Any]]: ...
    async def release(self, *, rid: str) -> dict[str, Any]: ...
    async def replay(self, *, rid: str) -> dict[str, Any]: ...
    async def snapshot(self, *, rid: str) -> dict[str, Any] | None: ...
    async def journal(self, rid: str, output: bool = True) -> list[dict[str, Any]]: ...
    async def read_file(self, sandbox: str, path: str) -> bytes: ...
    async def exec(self, rid: str, argv: list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: bytes | None = None,
                   timeout: float | None = None, key: str | None = None,
                   capture_limit: int | None = None
                   ) -> tuple[ExecResult, dict[str, Any]]: ...


class LocalJobs:
    """This node's `NodeJobs` awaited: every method of `NodeJobs` as a coroutine run on the
    shared executor, except `exec`, whose command goes over the loop's agent connection."""

    name = None  # this node

    def __init__(self, jobs: NodeJobs) -> None:
        self.jobs = jobs
        self.node = jobs.node

    def __getattr__(self, method: str) -> Any:
        fn = getattr(self.jobs, method)  # the journal's sqlite work: on the executor

        async def call(*args: Any, **kw: Any) -> Any:
            return await blocking(fn, *args, **kw)

        return call

    async def exec(self, rid: str, argv: list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: bytes | None = None,
                   timeout: float | None = None, key: str | None = None,
                   capture_limit: int | None = None) -> tuple[ExecResult, dict[str, Any]]:
        """As `NodeJobs.exec`: the step written, the command awaited, the step committed."""
        env = dict(env or {})
        while True:
            try:
                started = await self._begin(rid, argv, env, cwd, stdin, timeout, key)
                break
            except StepRunning:  # the key's step runs now: its result is waited for here,
                await asyncio.sleep(0.05)  # not in an executor thread
        if isinstance(started, tuple):
            return started  # a keyed step already done: served from the journal
        try:
            res = await async_node(self.node).exec(started.sandbox, argv, env=env, cwd=cwd,
                                                   stdin=stdin, timeout=timeout,
                                                   capture_limit=capture_limit)
        except BaseException:
            self.jobs.abort_step(started)  # one short write, kept out of a cancellable await
            raise
        return res, await asyncio.shield(blocking(self.jobs.end_step, started, res))

    async def _begin(self, rid: str, argv: list[str], env: dict[str, str], cwd: str | None,
                     stdin: bytes | None, timeout: float | None,
                     key: str | None) -> Step | tuple[ExecResult, dict[str, Any]]:
        begun = asyncio.get_running_loop().run_in_executor(
            executor(), lambda: self.jobs.begin_step(rid, argv, env=env, cwd=cwd, stdin=stdin,
                                                     timeout=timeout, key=key, wait=False))
        try:
            return await asyncio.shield(begun)
        except asyncio.CancelledError:  # the step may be written already: it is no step
            try:
                s = await begun
            except Exception:
                raise asyncio.CancelledError() from None
            if isinstance(s, Step):
                self.jobs.abort_step(s)
            raise

    async def read_file(self, sandbox: str, path: str) -> bytes:
        return await async_node(self.node).get_file(sandbox, path)


class RemoteJobs:
    """A cluster node's jobs over the loop's session to it (run/cluster/aio.py): the
    ``job`` request of the node service, method by method, as `run.cluster.jobs.RemoteJobs`
    sends it from threads."""

    def __init__(self, node: Any) -> None:
        self.node = node  # an AsyncRemoteNode
        self.name = node.name

    def __getattr__(self, method: str) -> Any:
        async def call(**kw: Any) -> Any:
            return await self.node.call("job", {"method": method, "args": kw})

        return call

    async def exec(self, rid: str, argv: list[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: bytes | None = None,
                   timeout: float | None = None, key: str | None = None,
                   capture_limit: int | None = None) -> tuple[ExecResult, dict[str, Any]]:
        from ..run.cluster.protocol import b64, from_wire

        r = await self.node.call("job", {"method": "exec", "args": {
            "rid": rid, "argv": list(argv), "env": env, "cwd": cwd,
            "stdin": None if stdin is None else b64(stdin), "timeout": timeout, "key": key,
            "capture_limit": capture_limit}})
        return from_wire(ExecResult, r["result"]), dict(r["step"])

    async def journal(self, rid: str, output: bool = True) -> list[dict[str, Any]]:
        from ..run.cluster.protocol import unb64

        docs = list(await self.node.call("job", {"method": "journal",
                                                 "args": {"rid": rid, "output": output}}))
        for d in docs:
            if "stdout" in d:
                d["stdout"], d["stderr"] = unb64(d["stdout"]), unb64(d["stderr"])
        return docs

    async def read_file(self, sandbox: str, path: str) -> bytes:
        return await self.node.get_file(sandbox, path)


def _remote(node: Any) -> RemoteJobs:
    """The async jobs of a threaded `RemoteNode`'s node."""
    from ..run.cluster.aio import AsyncRemoteNode

    return RemoteJobs(AsyncRemoteNode(node.entry, node.timeout))


async def journaled_exec(node: Node, sandbox_id: str, argv: list[str], *,
                         key: str | None = None, **kw: Any) -> ExecResult | None:
    """An exec into a job's sandbox on this node as a journaled step (as the sync
    `api.jobs.journaled_exec`); None when the sandbox belongs to no job."""
    jobs = node_jobs(node)

    def owned() -> str | None:
        sid = node.lookup(sandbox_id).id
        rows = jobs.db.q("SELECT id FROM rollouts WHERE sandbox=?", (sid,))
        return str(rows[0]["id"]) if rows else None

    rid = await blocking(owned)
    if rid is None:
        return None
    refuse_step_user(kw.get("user"), "user=")
    # the journal keeps the stdin to replay it, and the whole output (a result served
    # again must be the same): the caller gets it once the step is committed
    stdin = await _whole(kw.get("stdin"))
    res, _ = await LocalJobs(jobs).exec(rid, argv, env=kw.get("env"), cwd=kw.get("cwd"),
                                        stdin=stdin, timeout=kw.get("timeout"), key=key)
    on_output = kw.get("on_output")
    if on_output is not None:  # the output, once the step is committed (as the sync path)
        for kind, data in step_output(res):
            r = on_output(kind, data)
            if asyncio.iscoroutine(r):
                await r
    return res


class AsyncRollout(_RolloutDoc):
    """One sandbox of an `AsyncJob`: its execs are journaled steps (as `Rollout`)."""

    job: AsyncJob
    _jobs: AsyncJobs

    async def info(self) -> dict[str, Any]:
        self._doc = dict(await self._jobs.rollout(rid=self.id))
        return dict(self._doc)

    async def exec(self, cmd: str | list[str], *, key: str | None = None,
                   stdin: bytes | str | None = None, env: dict[str, str] | None = None,
                   cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        """As `Rollout.exec`: the rollout's next step; a retried ``key`` runs nothing."""
        argv, data = _step(cmd, stdin)
        res, step = await self._jobs.exec(self.id, argv, env=env, cwd=cwd, stdin=data,
                                          timeout=timeout, key=key)
        self._doc["sandbox"] = step["sandbox"]
        return res

    async def write_file(self, path: str, data: bytes | str, *, key: str | None = None) -> None:
        """Write a file as a journaled step (so replay writes it again)."""
        res = await self.exec(_write_step(path), key=key,
                              stdin=data.encode() if isinstance(data, str) else data)
        _check_written(path, res)

    async def read_file(self, path: str) -> bytes:
        return bytes(await self._jobs.read_file(_live_sandbox(self), path))

    async def journal(self, output: bool = True) -> list[dict[str, Any]]:
        return list(await self._jobs.journal(self.id, output))

    async def grades(self) -> list[dict[str, Any]]:
        """The rollout's grades in order, each with the step it followed (as `Rollout`)."""
        return list((await self.info())["grades"])

    async def replay(self) -> AsyncRollout:
        self._doc = dict(await self._jobs.replay(rid=self.id))
        return self

    async def snapshot(self) -> dict[str, Any] | None:
        out = await self._jobs.snapshot(rid=self.id)
        return None if out is None else dict(out)

    async def release(self) -> None:
        """Remove the sandbox and free its slot for a queued rollout; the journal stays."""
        self._doc = dict(await self._jobs.release(rid=self.id))
        if self._ticket:
            await self.job._jobs.release_slot(self._ticket)
            self._ticket = None


@dataclass
class AsyncMember(_MemberState):
    """One member of an `AsyncGroup` (as `Member`, see `_MemberState`)."""

    rollout: AsyncRollout | None = None
    _done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def wait(self, timeout: float | None = None) -> AsyncMember:
        """Until a queued member is admitted and created (or failed)."""
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except TimeoutError:
            raise DsecError(f"group member {self.index} is still queued after {timeout} s"
                            ) from None
        return self


@dataclass
class AsyncGroup(_GroupMembers[AsyncMember]):
    name: str
    members: list[AsyncMember]

    async def wait(self, timeout: float | None = None) -> AsyncGroup:
        await asyncio.wait_for(asyncio.gather(*(m.wait() for m in self.members)), timeout)
        return self

    async def release(self) -> None:
        await asyncio.gather(*(m.rollout.release() for m in self.members
                               if m.rollout is not None and m.rollout.status == "live"))


class AsyncJob:
    """A job on this node driven from asyncio (as `Job`): make one with ``await
    AsyncJob.start(name, ...)``, ``attach`` or ``resume``; its lease is renewed by a task of
    the loop until `close`. ``async with`` removes the job on exit."""

    def __init__(self, name: str, jobs: NodeJobs, job_settings: dict[str, Any]) -> None:
        self.name = name
        self._jobs = LocalJobs(jobs)
        self._settings = job_settings
        self._remote: dict[str, RemoteJobs] = {}  # cluster node name -> its jobs
        self._beat: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # queued members waiting for a slot
        self._closed = False

    @classmethod
    async def start(cls, name: str, *, ttl: float | str | None = None,
                    park_grace: float | str | None = None,
                    reclaim_grace: float | str | None = None,
                    retain: float | str | None = None, max_concurrent: int | None = None,
                    snapshot_every: int | None = None,
                    snapshot_interval: float | str | None = None, heartbeat: bool = True,
                    state_dir: str | Path | None = None, store: str | None = None) -> AsyncJob:
        """Start job ``name`` (or reattach to it, renewing its lease), as `Job.start`."""
        check_name(name)
        s = settings(ttl, park_grace, reclaim_grace, retain, max_concurrent, snapshot_every,
                     snapshot_interval)
        jobs = await blocking(_jobs, state_dir, store)
        await blocking(jobs.start, name, s)
        return cls(name, jobs, s)._beating(heartbeat)

    @classmethod
    async def attach(cls, name: str, *, heartbeat: bool = True,
                     state_dir: str | Path | None = None, store: str | None = None) -> AsyncJob:
        """An existing job (its lease renewed), with the cluster nodes holding its rollouts."""
        check_name(name)
        jobs = await blocking(_jobs, state_dir, store)
        doc = await blocking(jobs.reattach, name)
        job = cls(name, jobs, _doc_settings(doc))
        await job._find_remote()
        return job._beating(heartbeat)

    @classmethod
    async def resume(cls, name: str, *, replay_lost: bool = False, **kw: Any) -> AsyncJob:
        """As `Job.resume`: reattach after a trainer died; with ``replay_lost``, rollouts
        whose sandbox is gone are rebuilt first."""
        job = await cls.attach(name, **kw)
        if replay_lost:
            for ro in await job.rollouts(status=None):
                if _is_lost(ro._doc):
                    await ro.replay()
        return job

    def _beating(self, heartbeat: bool) -> AsyncJob:
        if heartbeat:
            self._beat = asyncio.get_running_loop().create_task(
                self._heartbeat(), name=f"job-{self.name}-heartbeat")
        return self

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(_beat_every(self._settings))
            for where, jobs in self._all_jobs():
                try:
                    await jobs.renew(name=self.name)
                except Exception as e:  # a missed beat is retried; the grace covers it
                    _beat_failed(self.name, where, e)

    async def _find_remote(self) -> None:
        """Cluster nodes that hold the job (each configured node is asked; one that does not
        answer is skipped)."""
        from ..run.cluster.registry import load_nodes
        from ..run.cluster.remote import RemoteNode

        async def ask(entry: Any) -> None:
            rj = _remote(RemoteNode(entry))
            try:
                await rj.reattach(name=self.name)
            except DsecError:
                return
            self._remote[entry.name] = rj

        await asyncio.gather(*(ask(e) for e in (await blocking(load_nodes)).values()))

    async def _remote_jobs(self, node: Any) -> RemoteJobs:
        rj = self._remote.get(node.name)
        if rj is None:
            rj = _remote(node)
            await rj.start(name=self.name, settings=self._settings, exist_ok=True)
            self._remote[node.name] = rj
        return rj

    def _all_jobs(self) -> list[tuple[str | None, Any]]:
        return [(None, self._jobs), *self._remote.items()]

    async def info(self) -> dict[str, Any]:
        return dict(await self._jobs.get(self.name))

    async def renew(self, ttl: float | str | None = None) -> dict[str, Any]:
        t = secs(ttl, "ttl")
        for _, jobs in self._all_jobs()[1:]:
            await jobs.renew(name=self.name, ttl=t)
        return dict(await self._jobs.renew(self.name, t))

    async def park(self) -> dict[str, Any]:
        """Pause every sandbox of the job, on every node holding some."""
        for _, jobs in self._all_jobs()[1:]:
            await jobs.park(name=self.name)
        return dict(await self._jobs.park(self.name))

    async def thaw(self, prefetch: bool = False) -> dict[str, Any]:
        """As `Job.thaw`: the nodes thaw side by side."""
        kw = {"prefetch": True} if prefetch else {}
        remote = [jobs.thaw(name=self.name, **kw) for _, jobs in self._all_jobs()[1:]]
        here, *_ = await asyncio.gather(self._jobs.thaw(self.name, prefetch), *remote)
        return dict(here)

    async def prewarm(self) -> asyncio.Task[dict[str, Any]]:
        """As `Job.prewarm`: returns at once with a task thawing the job with its memory
        read back (``warm = await job.prewarm()``); await the task before the turn that
        needs the sandboxes."""
        return asyncio.get_running_loop().create_task(self.thaw(prefetch=True))

    async def rollouts(self, status: str | None = "live") -> list[AsyncRollout]:
        """The job's rollouts on every node holding some (default: those with a sandbox)."""
        out = []
        for where, jobs in self._all_jobs():
            for d in await jobs.rollouts(name=self.name):
                if _wanted(d, status):
                    out.append(AsyncRollout(self, dict(d), jobs, where,
                                            d.get("ticket") if where else None))
        return out

    async def sandbox(self, image: str | Path, backend: str = "container", *,
                      group: str | None = None, index: int | None = None,
                      timeout: float | None = None, **options: Any) -> AsyncRollout:
        """One sandbox owned by the job, once the concurrency cap admits it (as
        `Job.sandbox`)."""
        opts = asdict(create_options(backend, **options))
        ticket = await self._jobs.acquire(self.name)
        try:
            await self._wait_slot(ticket, timeout)
            doc = await self._jobs.add_rollout(self.name, str(image), opts, group, index,
                                               ticket)
        except BaseException:
            await asyncio.shield(self._jobs.release_slot(ticket))
            raise
        return AsyncRollout(self, doc)

    async def _wait_slot(self, ticket: str, timeout: float | None) -> None:
        wait = _SlotWait(self.name, timeout)
        while not await self._jobs.admit(ticket):
            wait.check(self._closed, lambda: self._settings.get("max_concurrent"))
            await asyncio.sleep(0.05)

    async def group(self, n: int, image: str | Path, backend: str = "container", *,
                    node: str | None = None, nodes: list[str] | None = None,
                    **options: Any) -> AsyncGroup:
        """As `Job.group`: ``n`` rollouts of one image, one `AsyncMember` each; a member
        that cannot be created is an ``infra_failure``, members past the cap are ``queued``
        and created as slots free (`AsyncMember.wait`). ``node``: None/``local``, ``auto``
        (placed over the cluster) or a cluster node's name."""
        where, opts, name = _group_plan(n, backend, node, nodes, options)
        members = [AsyncMember(i, "queued") for i in range(n)]
        admitted = await blocking(_admit, self._jobs.jobs, self.name, members)
        loop = asyncio.get_running_loop()
        for m in members:
            if m not in admitted:
                t = loop.create_task(self._when_admitted(m, str(image), opts, name, where))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        await self._create_members(admitted, str(image), opts, name, where)
        return AsyncGroup(name, members)

    async def _when_admitted(self, m: AsyncMember, image: str, opts: dict[str, Any],
                             name: str, where: list[str] | None) -> None:
        try:
            await self._wait_slot(m.ticket or "", None)
        except BaseException as e:
            m.status, m.error = "infra_failure", str(e) or "cancelled"
            m._finish()
            if not isinstance(e, Exception):
                raise
            return
        await self._create_members([m], image, opts, name, where)

    async def _create_members(self, members: list[AsyncMember], image: str,
                              opts: dict[str, Any], name: str,
                              where: list[str] | None) -> None:
        if not members:
            return
        if where is None:
            await asyncio.gather(*(self._create_member(m, image, opts, name)
                                   for m in members))
            return
        await self._create_remote(members, image, opts, name, where)

    async def _create_member(self, m: AsyncMember, image: str, opts: dict[str, Any],
                             name: str) -> None:
        try:
            doc = await self._jobs.add_rollout(self.name, image, opts, name, m.index, m.ticket)
            m.rollout, m.status = AsyncRollout(self, doc), "ok"
        except Exception as e:  # reported per member, never failing the group
            await self._infra_failure(m, e)
        finally:
            m._finish()

    async def _create_remote(self, members: list[AsyncMember], image: str,
                             opts: dict[str, Any], name: str, where: list[str]) -> None:
        """Members placed over cluster nodes by the threaded placement fan-out (awaited on
        the shared executor), each journaled on its node."""
        from ..run.cluster.api import create_many
        from ..run.cluster.jobs import RemoteJobs as ThreadedRemoteJobs

        def make(i: int, node: Any) -> Any:
            rj = ThreadedRemoteJobs(node)
            rj.start(self.name, self._settings, exist_ok=True)
            doc = rj.add_rollout(self.name, image, opts, name, members[i].index,
                                 members[i].ticket)
            members[i].seconds = time.monotonic() - members[i]._t0
            return node, doc

        try:
            results = await blocking(create_many, len(members), image, CreateOptions(**opts),
                                     where, make=make)
        except DsecError as e:  # no node at all: every member is an infrastructure failure
            for m in members:
                await self._infra_failure(m, e)
                m._finish()
            return
        for m, r in zip(members, results, strict=False):
            if r.ok:
                node, doc = r.sandbox
                rj = self._remote.get(node.name) or self._remote.setdefault(node.name,
                                                                            _remote(node))
                m.rollout = AsyncRollout(self, doc, rj, r.node, m.ticket)
                m.status = "ok"
            else:
                await self._infra_failure(m, r.error)
            m._finish()

    async def _infra_failure(self, m: AsyncMember, e: Any) -> None:
        ticket = m.failed(self.name, e)
        if ticket:
            await self._jobs.release_slot(ticket)

    async def close(self) -> None:
        """Stop the heartbeat task and the queued members' tasks (the sandboxes stay,
        under the lease)."""
        self._closed = True
        tasks = [t for t in (self._beat, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._beat = None

    async def remove(self) -> dict[str, Any]:
        """Stop the heartbeat and remove every sandbox, snapshot and row of the job, on
        every node holding some."""
        await self.close()
        for _, jobs in self._all_jobs()[1:]:
            await jobs.remove(name=self.name)
        sids = [d["sandbox"] for d in await self._jobs.rollouts(self.name) if d["sandbox"]]
        out = dict(await self._jobs.remove(self.name))
        an = async_node(self._jobs.node)
        for sid in sids:  # the loop's connections to their agents
            await an.forget(sid)
        return out

    async def __aenter__(self) -> AsyncJob:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.remove()
