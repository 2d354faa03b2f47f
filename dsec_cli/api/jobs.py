"""Jobs: sandboxes owned by a trainer through a lease, in rollout groups, with every exec
journaled so a trainer that died reattaches, and a lost sandbox is rebuilt by replay.

    from dsec_cli.api.jobs import Job
    with Job.start("train-42", ttl="60s", max_concurrent=64) as job:
        group = job.group(8, "task@1", backend="container")
        for m in group.ok():
            r = m.rollout.exec("make test", key="turn-1")   # at most once per key
    # a new trainer process after a crash:
    job = Job.resume("train-42")
    for ro in job.rollouts():            # the live ones, each with ro.journal()
        ...

The job lives on this node (``jobs.db`` beside the node database, see run/jobs.py); its
lease is kept alive by a heartbeat thread while the `Job` is open. Node gc parks the job's
sandboxes past the park grace after the lease lapses and removes them past the reclaim grace.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from ..backends.base import ExecResult
from ..core import validate
from ..core.errors import DsecError, UsageError
from ..run.jobs import JobSettings, NodeJobs, check_name, node_jobs
from ..run.node import local_node
from ..run.options import CreateOptions
from .options import create_options, secs

__all__ = ["Job", "Rollout", "Group", "Member", "JobSettings", "list_jobs", "start_job",
           "renew_job", "park_job", "thaw_job", "remove_job", "journal", "grades", "replay",
           "job_rollouts"]

log = logging.getLogger(__name__)


def _jobs(state_dir: str | Path | None = None, store: str | None = None) -> NodeJobs:
    return node_jobs(local_node(state_dir, store))


_SETTINGS = ("ttl", "park_grace", "reclaim_grace", "retain", "max_concurrent",
             "snapshot_steps", "snapshot_seconds")


def _doc_settings(doc: dict[str, Any]) -> dict[str, Any]:
    """A job's settings from its row."""
    return {k: doc[k] for k in _SETTINGS}


def _is_lost(d: dict[str, Any]) -> bool:
    """A rollout a resumed trainer rebuilds: its sandbox is gone, or was being made or
    rebuilt when the trainer died."""
    return d["status"] in ("lost", "creating") or (d["status"] == "live" and not d["alive"])


def _group_where(n: int, node: str | None, nodes: list[str] | None) -> list[str] | None:
    """The checked size and placement of a group: None for this node, else the cluster
    nodes its members are placed over."""
    validate.node_option(node, "node")
    where: list[str] | None = None
    if node == "auto":
        from ..run.cluster.registry import load_nodes

        where = list(nodes or load_nodes())
        if not where:
            raise UsageError("node='auto' needs cluster nodes",
                             hint="dsec node add NAME USER@HOST")
    elif node not in (None, "local"):
        where = [str(node)]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"invalid group size {n!r}: expected a whole number >= 1")
    return where


class _SlotWait:
    """A rollout queued for a slot of the job's concurrency cap: when to give up."""

    def __init__(self, job: str, timeout: float | None) -> None:
        self.job, self.timeout = job, timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def check(self, closed: bool, cap: Callable[[], Any]) -> None:
        """Raise once the job was closed or the wait ran out (``cap``: the job's cap)."""
        if closed:
            raise DsecError(f"job {self.job} was closed while this rollout was queued")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DsecError(f"job {self.job}: no slot within {self.timeout} s "
                            f"(max_concurrent {cap()})")


def _beat_every(job_settings: dict[str, Any]) -> float:
    """Seconds between heartbeats: three per lease."""
    return max(job_settings.get("ttl", 60.0) / 3, 0.2)


def _beat_failed(job: str, where: str | None, e: Exception) -> None:
    log.warning("job %s: heartbeat to %s failed: %s", job, where or "this node", e)


def _group_plan(n: int, backend: str, node: str | None, nodes: list[str] | None,
                options: dict[str, Any]) -> tuple[list[str] | None, dict[str, Any], str]:
    """A group's placement (`_group_where`), its members' checked options (bad options fail
    the whole call) and its name."""
    where = _group_where(n, node, nodes)
    return where, asdict(create_options(backend, **options)), secrets.token_hex(4)


def settings(ttl: float | str | None = None, park_grace: float | str | None = None,
             reclaim_grace: float | str | None = None, retain: float | str | None = None,
             max_concurrent: int | None = None, snapshot_every: int | None = None,
             snapshot_interval: float | str | None = None, prefix: str = "") -> dict[str, Any]:
    """Checked job settings (only those given); errors name each option with ``prefix``."""
    out: dict[str, Any] = {}
    for name, v in (("ttl", ttl), ("park_grace", park_grace), ("reclaim_grace", reclaim_grace),
                    ("retain", retain), ("snapshot_seconds", snapshot_interval)):
        s = secs(v, prefix + name.replace("_", "-"))
        if s is not None:
            out[name] = s
    if max_concurrent is not None:
        out["max_concurrent"] = max_concurrent
    if snapshot_every is not None:
        out["snapshot_steps"] = snapshot_every
    JobSettings(**out).validate()
    return out


class _RolloutDoc:
    """What `Rollout` and `AsyncRollout` hold and read from their rollout's row."""

    def __init__(self, job: Any, doc: dict[str, Any], jobs: Any = None,
                 node: str | None = None, ticket: str | None = None) -> None:
        self.job = job
        self._doc = doc
        self._jobs = jobs if jobs is not None else job._jobs  # this node's or a cluster node's
        self.node = node  # a cluster node's name; None: this node
        self._ticket = ticket  # the home node's admission ticket (remote rollouts)

    @property
    def id(self) -> str:
        return str(self._doc["id"])

    @property
    def sandbox_id(self) -> str | None:
        return self._doc.get("sandbox")

    @property
    def status(self) -> str:
        return str(self._doc["status"])

    @property
    def last_step(self) -> int:
        return int(self._doc.get("last_step") or 0)

    def __repr__(self) -> str:
        where = f", node={self.node!r}" if self.node else ""
        return (f"{type(self).__name__}({self.id!r}, sandbox={self.sandbox_id!r}, "
                f"status={self.status!r}{where})")


def _step(cmd: str | list[str], stdin: bytes | str | None) -> tuple[list[str], bytes | None]:
    """A step's argv (a string runs under `sh -c`) and stdin bytes."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    return argv, stdin.encode() if isinstance(stdin, str) else stdin


def _live_sandbox(ro: _RolloutDoc) -> str:
    if not ro.sandbox_id:
        raise UsageError(f"rollout {ro.id} has no live sandbox")
    return ro.sandbox_id


def _wanted(doc: dict[str, Any], status: str | None) -> bool:
    """A rollout `rollouts(status)` lists (None: every one)."""
    return status is None or doc["status"] == status


def _write_step(path: str) -> list[str]:
    """The step that writes its stdin to ``path`` in the sandbox."""
    if not path.startswith("/"):
        raise UsageError(f"sandbox path {path!r} must be absolute")
    return ["/bin/sh", "-c", 'cat > "$1"', "sh", path]


def _check_written(path: str, res: ExecResult) -> None:
    if res.exit_code != 0:
        raise UsageError(f"cannot write {path}: {res.stderr.decode(errors='replace')}")


class Rollout(_RolloutDoc):
    """One sandbox of a job: its execs are journaled steps (on the node holding it)."""

    job: Job

    def info(self) -> dict[str, Any]:
        self._doc = self._jobs.rollout(self.id)
        return dict(self._doc)

    def exec(self, cmd: str | list[str], *, key: str | None = None,
             stdin: bytes | str | None = None, env: dict[str, str] | None = None,
             cwd: str | None = None, timeout: float | None = None) -> ExecResult:
        """Run a command as the rollout's next step. With ``key``, a retried call (from this
        process or a resumed trainer) returns the journaled result and runs nothing."""
        argv, data = _step(cmd, stdin)
        res, step = self._jobs.exec(self.id, argv, env=env, cwd=cwd, stdin=data,
                                        timeout=timeout, key=key)
        self._doc["sandbox"] = step["sandbox"]  # a rebuild (see `replay`) may have moved it
        return res

    def write_file(self, path: str, data: bytes | str, *, key: str | None = None) -> None:
        """Write a file as a journaled step (so replay writes it again)."""
        res = self.exec(_write_step(path), key=key,
                        stdin=data.encode() if isinstance(data, str) else data)
        _check_written(path, res)

    def read_file(self, path: str) -> bytes:
        return bytes(self._jobs.node.get_file(_live_sandbox(self), path))

    def journal(self, output: bool = True) -> list[dict[str, Any]]:
        """The rollout's steps in order (see `dsec journal`)."""
        return self._jobs.journal(self.id, output)

    def grades(self) -> list[dict[str, Any]]:
        """The rollout's grades in order (`dsec grade` of its sandbox), each with the step
        it followed: reward, pass/fail counts, tamper flag, infrastructure error."""
        return list(self.info()["grades"])

    def replay(self) -> Rollout:
        """Rebuild the rollout in a fresh sandbox (image + last snapshot + later steps)."""
        self._doc = self._jobs.replay(self.id)
        return self

    def snapshot(self) -> dict[str, Any] | None:
        return self._jobs.snapshot(self.id)

    def release(self) -> None:
        """Remove the sandbox and free its slot for a queued rollout; the journal stays."""
        self._doc = self._jobs.release(self.id)
        if self._ticket:
            self.job._jobs.release_slot(self._ticket)
            self._ticket = None


@dataclass
class _MemberState:
    """What `Member` and `AsyncMember` hold and say of themselves: ``status`` is ``ok``
    (``rollout`` set), ``queued`` (past the job's concurrency cap; `wait` for it) or
    ``infra_failure`` (the sandbox could not be created: ``error`` says why; a task failure
    is a rollout's own exit code)."""

    index: int
    status: Literal["ok", "queued", "infra_failure"]
    rollout: Any = None
    error: str | None = None
    ticket: str | None = None
    #: seconds from the group call until this member was created (or failed)
    seconds: float | None = None
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _done: Any = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def _finish(self) -> None:
        if self.seconds is None:  # a create made on another thread timed itself there
            self.seconds = time.monotonic() - self._t0
        self._done.set()

    def failed(self, job: str, e: object) -> str | None:
        """This member could not be created (logged); the slot ticket to give back."""
        log.warning("job %s: group member %d could not be created: %s", job, self.index, e)
        self.status, self.error = "infra_failure", str(e)
        return self.ticket

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "status": self.status, "error": self.error,
                "rollout": self.rollout.id if self.rollout else None,
                "sandbox": self.rollout.sandbox_id if self.rollout else None,
                "seconds": self.seconds}


_M = TypeVar("_M", bound=_MemberState)


def _admit(jobs: NodeJobs, job: str, members: list[_M]) -> list[_M]:
    """A new group's members each take a ticket of the job's queue, in index order; those
    the concurrency cap admits now (the rest wait for a slot), for `Job` and `AsyncJob`."""
    for m in members:
        m.ticket = jobs.acquire(job)
    return [m for m in members if jobs.admit(m.ticket or "")]


class _GroupMembers(Generic[_M]):
    """The member lists of `Group` and `AsyncGroup`."""

    members: list[_M]

    def ok(self) -> list[_M]:
        return [m for m in self.members if m.ok]

    def failed(self) -> list[_M]:
        return [m for m in self.members if m.status == "infra_failure"]


@dataclass
class Member(_MemberState):
    """One member of a group (see `_MemberState`)."""

    rollout: Rollout | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: float | None = None) -> Member:
        """Block until a queued member is admitted and created (or failed)."""
        if not self._done.wait(timeout):
            raise DsecError(f"group member {self.index} is still queued after {timeout} s")
        return self


@dataclass
class Group(_GroupMembers[Member]):
    name: str
    members: list[Member]

    def wait(self, timeout: float | None = None) -> Group:
        deadline = None if timeout is None else time.monotonic() + timeout
        for m in self.members:
            m.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        return self

    def release(self) -> None:
        for m in self.members:
            if m.rollout is not None and m.rollout.status == "live":
                m.rollout.release()


class Job:
    """A job on this node; ``Job(name)`` starts it (or reattaches to it, renewing its
    lease) and keeps its lease alive from a heartbeat thread until `close`."""

    def __init__(self, name: str, *, ttl: float | str | None = None,
                 park_grace: float | str | None = None,
                 reclaim_grace: float | str | None = None, retain: float | str | None = None,
                 max_concurrent: int | None = None, snapshot_every: int | None = None,
                 snapshot_interval: float | str | None = None, heartbeat: bool = True,
                 state_dir: str | Path | None = None, store: str | None = None,
                 _create: bool = True) -> None:
        check_name(name)
        self.name = name
        self._jobs = _jobs(state_dir, store)
        self._remote: dict[str, Any] = {}  # cluster node name -> RemoteJobs holding rollouts
        self._remote_lock = threading.Lock()
        if _create:
            self._settings = settings(ttl, park_grace, reclaim_grace, retain, max_concurrent,
                                      snapshot_every, snapshot_interval)
            self._jobs.start(name, self._settings)
        else:
            doc = self._jobs.reattach(name)
            self._settings = _doc_settings(doc)
            self._find_remote()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(8, thread_name_prefix=f"job-{name}")
        if heartbeat:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                          name=f"job-{name}-heartbeat")
            self._beat.start()

    @classmethod
    def start(cls, name: str, **kw: Any) -> Job:
        return cls(name, **kw)

    @classmethod
    def attach(cls, name: str, *, heartbeat: bool = True, state_dir: str | Path | None = None,
               store: str | None = None) -> Job:
        """An existing job (its lease renewed)."""
        return cls(name, heartbeat=heartbeat, state_dir=state_dir, store=store, _create=False)

    @classmethod
    def resume(cls, name: str, *, replay_lost: bool = False, **kw: Any) -> Job:
        """Reattach after a trainer died: `rollouts` then gives the live sandboxes with their
        journals; a keyed exec the dead trainer had started is served or rerun exactly once.
        With ``replay_lost``, rollouts whose sandbox is gone (or was being made or rebuilt
        when the trainer died) are rebuilt first (`Rollout.replay`)."""
        job = cls.attach(name, **kw)
        if replay_lost:
            for ro in job.rollouts(status=None):
                if _is_lost(ro._doc):
                    ro.replay()
        return job

    # -- cluster nodes holding rollouts of the job ----------------------------------------------
    def _remote_jobs(self, node: Any) -> Any:
        """The job on cluster node ``node`` (a RemoteNode), started there on first use."""
        from ..run.cluster.jobs import RemoteJobs

        with self._remote_lock:
            rj = self._remote.get(node.name)
        if rj is None:
            rj = RemoteJobs(node)
            rj.start(self.name, self._settings, exist_ok=True)
            with self._remote_lock:
                self._remote[node.name] = rj
        return rj

    def _find_remote(self) -> None:
        """Cluster nodes that hold the job (a resumed trainer does not know them): each
        configured node is asked; one that does not answer is skipped."""
        from ..run.cluster.jobs import RemoteJobs
        from ..run.cluster.registry import load_nodes
        from ..run.cluster.remote import RemoteNode

        for entry in load_nodes().values():
            rj = RemoteJobs(RemoteNode(entry))
            try:
                rj.reattach(self.name)
            except DsecError:
                continue  # no such job there, or the node does not answer
            self._remote[entry.name] = rj

    def _all_jobs(self) -> list[tuple[str | None, Any]]:
        with self._remote_lock:
            return [(None, self._jobs), *self._remote.items()]

    def _heartbeat(self) -> None:
        while not self._stop.wait(_beat_every(self._settings)):
            for where, jobs in self._all_jobs():
                try:
                    jobs.renew(self.name)
                except Exception as e:  # a missed beat is retried; the grace covers it
                    _beat_failed(self.name, where, e)

    def info(self) -> dict[str, Any]:
        return self._jobs.get(self.name)

    def renew(self, ttl: float | str | None = None) -> dict[str, Any]:
        t = secs(ttl, "ttl")
        for _, jobs in self._all_jobs()[1:]:
            jobs.renew(self.name, t)
        return self._jobs.renew(self.name, t)

    def park(self) -> dict[str, Any]:
        """Pause every sandbox of the job, on every node holding some."""
        for _, jobs in self._all_jobs()[1:]:
            jobs.park(self.name)
        return self._jobs.park(self.name)

    def thaw(self, prefetch: bool = False) -> dict[str, Any]:
        """Let every parked sandbox of the job run again, on every node holding some;
        ``prefetch`` also reads their memory back from swap now, ahead of need."""
        remote = self._all_jobs()[1:]
        if not remote:
            return self._jobs.thaw(self.name, prefetch)
        with ThreadPoolExecutor(len(remote)) as ex:  # the nodes thaw side by side
            done = [ex.submit(jobs.thaw, self.name, prefetch) for _, jobs in remote]
            here = self._jobs.thaw(self.name, prefetch)
            for f in done:
                f.result()
        return here

    def prewarm(self) -> Future[dict[str, Any]]:
        """Thaw the job with its memory read back, in the background: call it when the
        model starts generating the next turn, and the thaw is hidden behind it. The
        returned future holds what `thaw` returns; an exec of a parked sandbox before it
        is done is refused (the sandbox is still parked), so wait on it before the turn."""
        fut: Future[dict[str, Any]] = Future()

        def run() -> None:
            try:
                fut.set_result(self.thaw(prefetch=True))
            except BaseException as e:
                fut.set_exception(e)

        threading.Thread(target=run, name=f"dsec-prewarm-{self.name}", daemon=True).start()
        return fut

    def rollouts(self, status: str | None = "live") -> list[Rollout]:
        """The job's rollouts on every node holding some (default: those with a sandbox)."""
        return [Rollout(self, d, jobs, where, d.get("ticket") if where else None)
                for where, jobs in self._all_jobs() for d in jobs.rollouts(self.name)
                if _wanted(d, status)]

    def sandbox(self, image: str | Path, backend: str = "container", *,
                group: str | None = None, index: int | None = None,
                timeout: float | None = None, **options: Any) -> Rollout:
        """One sandbox owned by the job, created once the job's concurrency cap admits it
        (waiting in the queue up to ``timeout`` seconds)."""
        opts = asdict(create_options(backend, **options))
        ticket = self._jobs.acquire(self.name)
        try:
            self._wait_slot(ticket, timeout)
            doc = self._jobs.add_rollout(self.name, str(image), opts, group, index, ticket)
        except BaseException:
            self._jobs.release_slot(ticket)
            raise
        return Rollout(self, doc)

    def _wait_slot(self, ticket: str, timeout: float | None) -> None:
        wait = _SlotWait(self.name, timeout)
        while not self._jobs.admit(ticket):
            wait.check(self._stop.is_set(), lambda: self.info()["max_concurrent"])
            time.sleep(0.05)

    def group(self, n: int, image: str | Path, backend: str = "container", *,
              node: str | None = None, nodes: list[str] | None = None,
              **options: Any) -> Group:
        """``n`` rollouts of one image: one `Member` per index. A member that cannot be
        created is an ``infra_failure`` and the rest go on; members past the concurrency cap
        are ``queued`` and created as slots free (`Member.wait`, `Group.wait`).

        ``node``: None or ``local`` for this node; ``auto`` spreads the members over the
        cluster's nodes (or ``nodes``) by placement, as `create_many` does, and a cluster
        node's name puts them all there. Each member is journaled on its node."""
        where, opts, name = _group_plan(n, backend, node, nodes, options)
        members = [Member(i, "queued") for i in range(n)]
        admitted = _admit(self._jobs, self.name, members)
        for m in members:
            if m not in admitted:
                self._pool.submit(self._when_admitted, m, str(image), opts, name, where)
        self._create_members(admitted, str(image), opts, name, where)
        return Group(name, members)

    def _when_admitted(self, m: Member, image: str, opts: dict[str, Any], name: str,
                       where: list[str] | None) -> None:
        try:
            self._wait_slot(m.ticket or "", None)
        except BaseException as e:
            m.status, m.error = "infra_failure", str(e)
            m._finish()
            return
        self._create_members([m], image, opts, name, where)

    def _create_members(self, members: list[Member], image: str, opts: dict[str, Any],
                        name: str, where: list[str] | None) -> None:
        if not members:
            return
        if where is None:
            with ThreadPoolExecutor(min(8, len(members))) as ex:
                list(ex.map(lambda m: self._create_member(m, image, opts, name), members))
            return
        from ..run.cluster.api import create_many

        def make(i: int, node: Any) -> Any:
            rj = self._remote_jobs(node)
            doc = rj.add_rollout(self.name, image, opts, name, members[i].index,
                                 members[i].ticket)
            members[i].seconds = time.monotonic() - members[i]._t0
            return rj, doc

        try:
            results = create_many(len(members), image, CreateOptions(**opts), where,
                                  make=make)
        except DsecError as e:  # no node at all: every member is an infrastructure failure
            results = []
            for m in members:
                self._infra_failure(m, e)
        for m, r in zip(members, results, strict=False):
            if r.ok:
                rj, doc = r.sandbox
                m.rollout = Rollout(self, doc, rj, r.node, m.ticket)
                m.status = "ok"
                m._finish()
            else:
                self._infra_failure(m, r.error)

    def _infra_failure(self, m: Member, e: Any) -> None:
        ticket = m.failed(self.name, e)
        if ticket:
            self._jobs.release_slot(ticket)
        m._finish()

    def _create_member(self, m: Member, image: str, opts: dict[str, Any], name: str) -> None:
        try:
            doc = self._jobs.add_rollout(self.name, image, opts, name, m.index, m.ticket)
            m.rollout, m.status = Rollout(self, doc), "ok"
        except Exception as e:  # reported per member, never failing the group
            ticket = m.failed(self.name, e)
            if ticket:
                self._jobs.release_slot(ticket)
        finally:
            m._finish()

    def close(self) -> None:
        """Stop the heartbeat (the sandboxes stay, under the lease)."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def remove(self) -> dict[str, Any]:
        """Stop the heartbeat and remove every sandbox, snapshot and row of the job, on
        every node holding some."""
        self.close()
        for _, jobs in self._all_jobs()[1:]:
            jobs.remove(self.name)
        return self._jobs.remove(self.name)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


# -- the functions the CLI calls ----------------------------------------------------------------
def start_job(name: str, state_dir: str | Path | None = None,
              **kw: Any) -> dict[str, Any]:
    """Start a job from the command line: no heartbeat, its lease lasts ``ttl`` unless
    renewed (`dsec job renew`)."""
    check_name(name)
    return _jobs(state_dir).start(name, settings(**kw, prefix="--"), exist_ok=False)


def list_jobs(state_dir: str | Path | None = None) -> list[dict[str, Any]]:
    return _jobs(state_dir).ls()


def job_rollouts(name: str, state_dir: str | Path | None = None) -> list[dict[str, Any]]:
    return _jobs(state_dir).rollouts(name)


def renew_job(name: str, ttl: float | str | None = None,
              state_dir: str | Path | None = None) -> dict[str, Any]:
    return _jobs(state_dir).renew(name, secs(ttl, "--ttl"))


def park_job(name: str, state_dir: str | Path | None = None) -> dict[str, Any]:
    return _jobs(state_dir).park(name)


def thaw_job(name: str, state_dir: str | Path | None = None, prefetch: bool = False
             ) -> dict[str, Any]:
    return _jobs(state_dir).thaw(name, prefetch)


def remove_job(name: str, state_dir: str | Path | None = None) -> dict[str, Any]:
    return _jobs(state_dir).remove(name)


def create_in_job(name: str, image: str, opts: Any, state_dir: str | Path | None = None,
                  timeout: float | None = None) -> dict[str, Any]:
    """A sandbox owned by job ``name`` (what `dsec run --job` does), created once the job's
    concurrency cap admits it: past the cap it waits in the job's queue (``timeout``
    seconds at most; None: as long as it takes)."""
    jobs = _jobs(state_dir)
    ticket = jobs.acquire(name)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not jobs.admit(ticket):
            if deadline is not None and time.monotonic() > deadline:
                raise DsecError(f"job {name!r} is at its concurrency cap: no slot within "
                                f"{timeout:g} s", hint="`dsec job ls` shows its queue")
            time.sleep(0.1)
        return jobs.add_rollout(name, image, asdict(opts), ticket=ticket)
    except BaseException:
        jobs.release_slot(ticket)
        raise


def run_in_job(name: str, image: str, opts: Any, cmd: list[str] | None = None,
               timeout: float | None = None, state_dir: str | Path | None = None
               ) -> tuple[dict[str, Any], ExecResult | None]:
    """`dsec run --job`: a sandbox owned by the job, with ``cmd`` as its first journaled
    step; the sandbox stays (the job owns it)."""
    doc = create_in_job(name, image, opts, state_dir)
    res = None
    if cmd:
        res, _ = _jobs(state_dir).exec(doc["id"], cmd, timeout=timeout)
    return _jobs(state_dir).rollout(doc["id"]), res


def journaled_exec(node: Any, sandbox_id: str, argv: list[str], **kw: Any
                   ) -> ExecResult | None:
    """An exec into a job's sandbox, as a journaled step (`dsec exec` on a job sandbox);
    None when the sandbox belongs to no job."""
    jobs = node_jobs(node)
    sid = node.lookup(sandbox_id).id
    if not jobs.db.q("SELECT 1 FROM rollouts WHERE sandbox=?", (sid,)):
        return None
    refuse_step_user(kw.get("user"))
    stdin = kw.get("stdin")
    if stdin is not None and not isinstance(stdin, bytes):
        stdin = b"".join(stdin)  # the journal keeps the stdin to replay it
    # the journal keeps the whole output (a result served again must be the same), and the
    # caller gets it once the step is committed
    res, _ = jobs.exec(sid, argv, env=kw.get("env"), cwd=kw.get("cwd"), stdin=stdin,
                       timeout=kw.get("timeout"), key=kw.get("key"))
    on_output = kw.get("on_output")
    if on_output is not None:
        for kind, data in step_output(res):
            on_output(kind, data)
    return res


def refuse_step_user(user: str | None, spelled: str = "--user") -> None:
    """A job's steps run as its sandbox's user (replay runs them again as that user)."""
    if user is not None:
        raise UsageError(f"a job's steps run as its sandbox's user: {spelled} is not taken "
                         "here")


def step_output(res: ExecResult) -> list[tuple[str, bytes]]:
    """A journaled step's output as an exec's callback gets it: whole, once the step is
    committed (the journal keeps it whole: a result served again must be the same)."""
    return [(kind, data) for kind, data in (("stdout", res.stdout), ("stderr", res.stderr))
            if data]


def _holder(rollout: str, state_dir: str | Path | None) -> tuple[Any, str]:
    """The jobs of the node holding a rollout: ``NODE/ID`` names a cluster node."""
    node, sep, rid = rollout.rpartition("/")
    if not sep:
        return _jobs(state_dir), rollout
    validate.node_name(node)
    from ..run.cluster.jobs import RemoteJobs
    from ..run.cluster.registry import get_node

    return RemoteJobs(get_node(node)), rid


def journal(rollout: str, output: bool = True,
            state_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The steps of a rollout (by rollout id or sandbox id; ``NODE/ID`` on a cluster
    node)."""
    jobs, rid = _holder(rollout, state_dir)
    return list(jobs.journal(rid, output))


def grades(rollout: str, state_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The grades journaled with a rollout (by rollout id or sandbox id; ``NODE/ID`` on a
    cluster node)."""
    jobs, rid = _holder(rollout, state_dir)
    return list(jobs.rollout(rid).get("grades", []))


def replay(rollout: str, state_dir: str | Path | None = None) -> dict[str, Any]:
    """Rebuild a rollout in a fresh sandbox from its image, last snapshot and journal."""
    jobs, rid = _holder(rollout, state_dir)
    return dict(jobs.replay(rid))
