"""Jobs on a node: leases, rollouts, admission slots and the trajectory journal.

A job owns sandboxes through a lease that its trainer renews. Each sandbox of a job is a
*rollout*: a trajectory whose every exec is a journaled *step* (argv, cwd, env, stdin and its
digest, result, the writable state's digest before and after, duration), written to
``jobs.db`` beside the node database (sqlite WAL, ``synchronous=FULL``: a committed step
survives a crash of the trainer or the node). A step is written as ``running`` before the
command starts and completed after, so a step interrupted by a dead trainer is known:

- an exec carrying an idempotency key whose step is done returns the journaled result and
  runs nothing;
- one whose step was interrupted runs again only where the sandbox's state digest still
  equals the digest before that step (the command changed nothing); otherwise the rollout is
  rebuilt first (`replay`), so the step never runs twice on one state.

`replay` makes a fresh sandbox from the image plus the rollout's last snapshot (a layer
taken every K steps or T seconds with the node's snapshot machinery, so it dedups against the
image), re-executes the committed steps after that snapshot, checking each recorded state
digest, and leaves the journal's results as they were.

`sweep` (called by node gc) applies the lease: past ``park_grace`` after the lease expired
the job's sandboxes are parked; past ``reclaim_grace`` they are removed and the rollouts marked
lost; past ``retain`` more the job's rows and snapshot refs go too. Admission slots cap the
rollouts a job holds at once; requests past the cap queue in ticket order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import _rootfs, backend_class
from ..backends.base import ExecResult
from ..core import validate
from ..core.errors import NotFoundError, SandboxError, UsageError
from ..core.sqlite import immediate, thread_connection
from .options import CreateOptions
from .statedigest import state_digest

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    created REAL NOT NULL,
    ttl REAL NOT NULL,              -- seconds a renewal keeps the lease
    expires REAL NOT NULL,          -- the lease's end
    park_grace REAL NOT NULL,       -- after expiry: sandboxes parked
    reclaim_grace REAL NOT NULL,    -- after expiry: sandboxes removed
    retain REAL NOT NULL,           -- after reclaim: journal and snapshots removed
    max_concurrent INTEGER NOT NULL,  -- 0: no cap
    snapshot_steps INTEGER NOT NULL,  -- 0: never by step count
    snapshot_seconds REAL NOT NULL,   -- 0: never by time
    parked INTEGER NOT NULL DEFAULT 0,  -- parked: by hand or by the lease
    reclaimed REAL,
    hold_mean REAL NOT NULL DEFAULT 0,  -- mean seconds a slot is held (queue ETA)
    hold_n INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    sandbox TEXT,                   -- the sandbox holding it now (NULL: lost or released)
    image TEXT NOT NULL,
    opts TEXT NOT NULL,             -- CreateOptions (JSON)
    base_layers INTEGER NOT NULL,   -- lower dirs of the image itself
    grp TEXT,
    idx INTEGER,
    ticket TEXT,
    created REAL NOT NULL,
    status TEXT NOT NULL,           -- creating | live | lost | released
    snap_step INTEGER NOT NULL DEFAULT 0,
    snap_image TEXT,
    snap_time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    rollout TEXT NOT NULL REFERENCES rollouts(id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    key TEXT,
    argv TEXT NOT NULL,
    cwd TEXT,
    env TEXT NOT NULL,
    stdin BLOB,
    stdin_digest TEXT,
    timeout REAL,
    state TEXT NOT NULL,            -- running | done
    result TEXT,                    -- the ExecResult without its output (JSON)
    stdout BLOB,
    stderr BLOB,
    before TEXT,
    after TEXT,
    started REAL NOT NULL,
    duration REAL,
    owner_pid INTEGER,
    owner_start INTEGER,
    PRIMARY KEY (rollout, step),
    UNIQUE (rollout, key)
);
CREATE TABLE IF NOT EXISTS grades (
    rollout TEXT NOT NULL REFERENCES rollouts(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,           -- 1, 2, ... per rollout
    after_step INTEGER NOT NULL,    -- the last done step when it was graded (0: none)
    sandbox TEXT NOT NULL,
    grader TEXT NOT NULL,
    reward REAL NOT NULL,
    passed INTEGER NOT NULL,        -- every test passed
    tests_passed INTEGER NOT NULL,
    tests_failed INTEGER NOT NULL,  -- every other outcome (failed, error, skipped, missing)
    tampered INTEGER NOT NULL,
    infra_error TEXT NOT NULL,      -- '': the grading itself worked
    result TEXT NOT NULL,           -- the GradeResult without its log (JSON)
    finished REAL NOT NULL,
    PRIMARY KEY (rollout, seq)
);
CREATE TABLE IF NOT EXISTS slots (
    ticket TEXT PRIMARY KEY,
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    state TEXT NOT NULL,            -- queued | held
    enqueued REAL NOT NULL,
    admitted REAL,
    owner_pid INTEGER,
    owner_start INTEGER
);
"""

#: the env variable naming a job sandbox's rollout (how orphans are found after a crash)
TAG = "DSEC_ROLLOUT"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
KEY_MAX = 512


@dataclass
class JobSettings:
    """A job's lease and snapshot policy (seconds; 0 turns a policy off)."""

    ttl: float = 60.0
    park_grace: float = 60.0
    reclaim_grace: float = 600.0
    retain: float = 3600.0
    max_concurrent: int = 0
    snapshot_steps: int = 20
    snapshot_seconds: float = 300.0

    def validate(self) -> None:
        for name in ("ttl", "park_grace", "reclaim_grace", "retain", "snapshot_seconds"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise UsageError(f"invalid {name.replace('_', '-')} {v!r}: expected a finite "
                                 "number of seconds >= 0")
        if self.ttl <= 0:
            raise UsageError(f"invalid ttl {self.ttl}: must be above 0")
        if self.reclaim_grace < self.park_grace:
            raise UsageError(f"invalid reclaim-grace {self.reclaim_grace}: must be at least the "
                             f"park grace ({self.park_grace})")
        for name in ("max_concurrent", "snapshot_steps"):
            validate.positive_int(getattr(self, name), name.replace("_", "-"), minimum=0)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(f"invalid job name {name!r}: use 1-63 characters a-z, 0-9, '.', '_' "
                         "or '-', starting with a letter or digit")
    return name


def check_key(key: str | None) -> str | None:
    if key is not None and (not isinstance(key, str) or not key or len(key) > KEY_MAX
                            or "\0" in key):
        raise UsageError(f"invalid idempotency key {key!r}: expected 1-{KEY_MAX} characters "
                         "without NUL")
    return key


def _owner() -> tuple[int, int | None]:
    return os.getpid(), _rootfs.proc_start_time(os.getpid())


def _result_doc(res: ExecResult) -> str:
    doc = asdict(res)
    doc.pop("stdout")
    doc.pop("stderr")
    return json.dumps(doc)


class StepRunning(SandboxError):
    """A keyed step is being run by a live process (`NodeJobs.begin_step` with ``wait=False``)."""


@dataclass(frozen=True)
class Step:
    """A journaled step whose command is running (from `NodeJobs.begin_step`)."""

    rollout: str
    step: int
    sandbox: str
    t0: float


class JobStore:
    """The rows of ``jobs.db``; one short transaction per change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        db = self._connect()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = thread_connection(self._local, "db", self.path,
                               ("foreign_keys=ON", "synchronous=FULL"))
        db.row_factory = sqlite3.Row
        return db

    @contextmanager
    def tx(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """A write transaction; ``durable=False`` commits without the fsync (WAL with
        ``synchronous=NORMAL``: it survives a crash of any process, not a power loss)."""
        db = self._connect()
        mode = "FULL" if durable else "NORMAL"
        if getattr(self._local, "sync", "FULL") != mode:
            db.execute(f"PRAGMA synchronous={mode}")
            self._local.sync = mode
        with immediate(db) as db:
            yield db

    def q(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self._connect().execute(sql, args).fetchall()


class NodeJobs:
    """The jobs of one node. Every method takes and returns plain values (the node service
    serves them to cluster clients as they are)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.db = JobStore(node.root / "jobs.db")
        self._running: set[tuple[str, int]] = set()  # steps this process runs now
        self._running_lock = threading.Lock()

    def _elsewhere(self, s: sqlite3.Row) -> bool:
        """Whether a ``running`` step is still being run (by a live process, or by another
        thread of this one), rather than left behind by a dead one."""
        if s["owner_pid"] == os.getpid():
            with self._running_lock:
                return (s["rollout"], s["step"]) in self._running
        return _rootfs.alive(s["owner_pid"], s["owner_start"])

    # -- jobs ----------------------------------------------------------------------------------
    def start(self, name: str, settings: dict[str, Any] | None = None,
              exist_ok: bool = True) -> dict[str, Any]:
        """Create job ``name`` with its lease running from now, or (``exist_ok``) renew the
        existing one and return it."""
        check_name(name)
        s = JobSettings(**(settings or {}))
        s.validate()
        t = time.time()
        with self.db.tx() as db:
            row = db.execute("SELECT name FROM jobs WHERE name=?", (name,)).fetchone()
            if row is not None and not exist_ok:
                raise UsageError(f"job {name!r} exists", hint=f"dsec job rm {name}")
            if row is None:
                db.execute("INSERT INTO jobs (name, created, ttl, expires, park_grace, "
                           "reclaim_grace, retain, max_concurrent, snapshot_steps, "
                           "snapshot_seconds) VALUES (?,?,?,?,?,?,?,?,?,?)",
                           (name, t, s.ttl, t + s.ttl, s.park_grace, s.reclaim_grace, s.retain,
                            s.max_concurrent, s.snapshot_steps, s.snapshot_seconds))
        if row is not None:
            self.renew(name)
        return self.get(name)

    def _job(self, name: str) -> sqlite3.Row:
        check_name(name)
        rows = self.db.q("SELECT * FROM jobs WHERE name=?", (name,))
        if not rows:
            raise NotFoundError(f"no job {name!r} on this node", hint="list them with "
                                "`dsec job ls`")
        return rows[0]

    def get(self, name: str) -> dict[str, Any]:
        return self._describe(self._job(name))

    def ls(self) -> list[dict[str, Any]]:
        return [self._describe(r) for r in self.db.q("SELECT * FROM jobs ORDER BY created")]

    def _describe(self, j: sqlite3.Row) -> dict[str, Any]:
        t = time.time()
        counts = {r["status"]: r["n"] for r in self.db.q(
            "SELECT status, count(*) AS n FROM rollouts WHERE job=? GROUP BY status",
            (j["name"],))}
        queued = self.db.q("SELECT ticket FROM slots WHERE job=? AND state='queued' "
                           "ORDER BY rowid", (j["name"],))
        held = self.db.q("SELECT count(*) AS n FROM slots WHERE job=? AND state='held'",
                         (j["name"],))[0]["n"]
        if j["reclaimed"] is not None:
            lease = "reclaimed"
        elif t <= j["expires"]:
            lease = "parked" if j["parked"] else "active"
        else:
            lease = "parked" if j["parked"] else "expired"
        eta = None
        if queued and j["max_concurrent"] and j["hold_n"]:
            # the last queued ticket waits for ceil(queued / cap) generations of held slots
            eta = math.ceil(len(queued) / j["max_concurrent"]) * j["hold_mean"]
        return {"name": j["name"], "created": j["created"], "lease": lease,
                "expires": j["expires"], "ttl": j["ttl"], "park_grace": j["park_grace"],
                "reclaim_grace": j["reclaim_grace"], "retain": j["retain"],
                "max_concurrent": j["max_concurrent"], "snapshot_steps": j["snapshot_steps"],
                "snapshot_seconds": j["snapshot_seconds"], "parked": bool(j["parked"]),
                "rollouts": counts.get("live", 0), "lost": counts.get("lost", 0),
                "released": counts.get("released", 0), "held": held, "queued": len(queued),
                "queue_eta": eta}

    def renew(self, name: str, ttl: float | None = None) -> dict[str, Any]:
        """Extend the lease by its ttl (or ``ttl``) from now; sandboxes the lease had parked
        are thawed."""
        if ttl is not None and not (math.isfinite(ttl) and ttl > 0):
            raise UsageError(f"invalid ttl {ttl}: must be a finite number of seconds above 0")
        j = self._job(name)
        if j["reclaimed"] is not None:
            raise SandboxError(f"job {name!r} was reclaimed after its lease expired",
                               hint="start a new job; `dsec replay` rebuilds its rollouts")
        t = time.time()
        ttl = ttl or j["ttl"]
        with self.db.tx() as db:
            db.execute("UPDATE jobs SET expires=?, ttl=? WHERE name=?", (t + ttl, ttl, name))
        self._extend_sandboxes(name, t + ttl + j["reclaim_grace"])
        if j["parked"] == 2:  # parked by the lease, not by hand
            self.thaw(name)
        return self.get(name)

    def _extend_sandboxes(self, name: str, horizon: float) -> None:
        """Job sandboxes carry a TTL at the reclaim horizon: a sandbox whose rollout row was
        never written (a crash between the two) is still removed by node gc."""
        sids = [r["sandbox"] for r in self.db.q(
            "SELECT sandbox FROM rollouts WHERE job=? AND sandbox IS NOT NULL", (name,))]
        with self.node.db.tx() as db:
            db.executemany("UPDATE sandboxes SET expires=? WHERE id=?",
                           [(horizon, s) for s in sids])

    def park(self, name: str, by_lease: bool = False) -> dict[str, Any]:
        """Park every live sandbox of the job: stopped, its memory pushed out (density.py);
        backends that cannot stop keep running."""
        self._job(name)
        with self.db.tx() as db:
            db.execute("UPDATE jobs SET parked=? WHERE name=?", (2 if by_lease else 1, name))
        for r in self._live_rollouts(name):
            try:
                rec = self.node.lookup(r["sandbox"])
                if rec.status == "running" and self.node.backend(rec.backend).supports_pause:
                    try:
                        self.node.park(rec.id)
                    except UsageError:  # nothing to reclaim from (no cgroup): stopped only
                        self.node.pause(rec.id)
            except Exception as e:  # one sandbox that cannot be paused does not stop the rest
                log.warning("job %s: cannot park sandbox %s: %s", name, r["sandbox"], e)
        return self.get(name)

    def thaw(self, name: str, prefetch: bool = False) -> dict[str, Any]:
        """Let the job's parked sandboxes run again; ``prefetch`` also reads every live
        sandbox's memory back from swap now, several at once (a pre-warm)."""
        self._job(name)

        def one(sid: str) -> None:
            try:
                status = self.node.lookup(sid).status
                if status == "parked" or (prefetch and status == "running"):
                    self.node.thaw(sid, prefetch)
                elif status == "paused":  # parked by an older dsec, or paused by hand
                    self.node.resume(sid)
            except Exception as e:
                log.warning("job %s: cannot thaw sandbox %s: %s", name, sid, e)

        sids = [r["sandbox"] for r in self._live_rollouts(name)]
        if prefetch and len(sids) > 1:  # reads from swap overlap: the disk queues them
            with ThreadPoolExecutor(min(8, len(sids))) as ex:
                list(ex.map(one, sids))
        else:
            for sid in sids:
                one(sid)
        with self.db.tx() as db:
            db.execute("UPDATE jobs SET parked=0 WHERE name=?", (name,))
        return self.get(name)

    def remove(self, name: str) -> dict[str, Any]:
        """Remove the job's sandboxes, snapshot refs and rows."""
        self._job(name)
        removed = self._remove_sandboxes(name, "released")
        for rec in self._tagged(name):
            try:
                self.node.remove(rec.id)
                removed.append(rec.id)
            except NotFoundError:
                pass
        snaps = [r["snap_image"] for r in self.db.q(
            "SELECT snap_image FROM rollouts WHERE job=? AND snap_image IS NOT NULL", (name,))]
        with self.db.tx() as db:
            db.execute("DELETE FROM jobs WHERE name=?", (name,))
        self._remove_snapshots(name, snaps)
        return {"name": name, "removed": removed}

    def _live_rollouts(self, name: str) -> list[sqlite3.Row]:
        return self.db.q("SELECT * FROM rollouts WHERE job=? AND status='live' "
                         "AND sandbox IS NOT NULL", (name,))

    def _remove_sandboxes(self, name: str, status: str) -> list[str]:
        removed = []
        for r in self._live_rollouts(name):
            try:
                self.node.remove(r["sandbox"])
            except NotFoundError:
                pass
            removed.append(r["sandbox"])
            self._set_rollout(r["id"], sandbox=None, status=status)
            if r["ticket"]:
                self.release_slot(r["ticket"])
        return removed

    def _remove_snapshots(self, name: str, images: list[str]) -> None:
        """Snapshot refs (image and layer) of a removed job; store gc frees their packs."""
        from ..format.refs import delete_ref
        from ..push.stores.retrying import open_retrying

        refs = [r for img in images for r in (img, img.replace("@", "-layer@", 1))]
        if not refs:
            return
        try:
            with open_retrying(self.node.store_url) as st:
                for ref in refs:
                    try:
                        delete_ref(st, ref)
                    except NotFoundError:
                        pass
        except Exception as e:  # the job is gone; leftover refs are only store garbage
            log.warning("job %s: cannot remove snapshot refs: %s", name, e)

    # -- admission -----------------------------------------------------------------------------
    def acquire(self, name: str) -> str:
        """A ticket in the job's queue (admitted at once while under the cap)."""
        self._job(name)
        ticket = secrets.token_hex(8)
        pid, start = _owner()
        with self.db.tx() as db:
            db.execute("INSERT INTO slots VALUES (?,?,?,?,?,?,?)",
                       (ticket, name, "queued", time.time(), None, pid, start))
        self.admit(ticket)
        return ticket

    def admit(self, ticket: str) -> bool:
        """Whether the ticket holds a slot now (taking one if it is first in line)."""
        with self.db.tx() as db:
            row = db.execute("SELECT s.state, s.job, j.max_concurrent FROM slots s JOIN jobs j "
                             "ON j.name=s.job WHERE ticket=?", (ticket,)).fetchone()
            if row is None:
                raise NotFoundError(f"no admission ticket {ticket!r}")
            if row["state"] == "held":
                return True
            cap = row["max_concurrent"]
            if cap:
                held = db.execute("SELECT count(*) FROM slots WHERE job=? AND state='held'",
                                  (row["job"],)).fetchone()[0]
                ahead = db.execute("SELECT ticket FROM slots WHERE job=? AND state='queued' "
                                   "ORDER BY rowid LIMIT ?",
                                   (row["job"], max(cap - held, 0))).fetchall()
                if ticket not in {a[0] for a in ahead}:
                    return False
            db.execute("UPDATE slots SET state='held', admitted=? WHERE ticket=?",
                       (time.time(), ticket))
            return True

    def release_slot(self, ticket: str) -> None:
        with self.db.tx() as db:
            row = db.execute("SELECT job, state, admitted FROM slots WHERE ticket=?",
                             (ticket,)).fetchone()
            if row is None:
                return
            db.execute("DELETE FROM slots WHERE ticket=?", (ticket,))
            if row["state"] == "held" and row["admitted"]:
                held = time.time() - row["admitted"]
                db.execute("UPDATE jobs SET hold_mean=(hold_mean*hold_n+?)/(hold_n+1), "
                           "hold_n=min(hold_n+1, 50) WHERE name=?", (held, row["job"]))

    # -- rollouts ------------------------------------------------------------------------------
    def add_rollout(self, name: str, image: str, opts: dict[str, Any],
                    group: str | None = None, index: int | None = None,
                    ticket: str | None = None) -> dict[str, Any]:
        """Create a sandbox owned by the job, as a new rollout."""
        j = self._job(name)
        if j["reclaimed"] is not None or time.time() > j["expires"] + j["park_grace"]:
            raise SandboxError(f"job {name!r}'s lease has expired", hint=f"dsec job renew {name}")
        CreateOptions(**opts).validate()
        rid = secrets.token_hex(6)
        t = time.time()
        # the row first: a crash during the create leaves a tagged sandbox that
        # `collect_orphans` finds, never one that nothing knows about
        with self.db.tx() as db:
            db.execute("INSERT INTO rollouts (id, job, sandbox, image, opts, base_layers, "
                       "grp, idx, ticket, created, status, snap_time) "
                       "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       (rid, name, None, image, json.dumps(opts), 0, group, index, ticket, t,
                        "creating", t))
        try:
            rec = self._create(rid, j, image, opts)
        except BaseException:
            with self.db.tx() as db:
                db.execute("DELETE FROM rollouts WHERE id=?", (rid,))
            raise
        self._set_rollout(rid, sandbox=rec.id, base_layers=len(rec.layers), status="live")
        return self.rollout(rid)

    def _create(self, rid: str, j: sqlite3.Row, image: str, opts: dict[str, Any]) -> Any:
        """A sandbox for rollout ``rid``, tagged with it (``DSEC_ROLLOUT`` in its env) and
        expiring at the job's reclaim horizon."""
        o = CreateOptions(**opts)
        o.env = {**o.env, TAG: rid}
        o.ttl = max(j["expires"] - time.time(), 1.0) + j["reclaim_grace"]
        rec = self.node.create(image, o)
        self._set_rollout(rid, sandbox=rec.id)
        return rec

    def _tagged(self, name: str) -> list[Any]:
        """The node's sandboxes made for the job's rollouts (by their tag)."""
        rids = {r["id"] for r in self.db.q("SELECT id FROM rollouts WHERE job=?", (name,))}
        return [rec for rec in self.node.db.all()
                if (rec.spec.get("env") or {}).get(TAG) in rids]

    def collect_orphans(self, name: str) -> list[str]:
        """Remove sandboxes made for the job's rollouts that no rollout holds (their creator
        died before linking them, or before removing the one a replay replaced)."""
        current = {r["sandbox"] for r in self.db.q(
            "SELECT sandbox FROM rollouts WHERE job=? AND sandbox IS NOT NULL", (name,))}
        out = []
        for rec in self._tagged(name):
            if rec.id in current or _rootfs.alive(rec.owner_pid, rec.owner_start):
                continue
            try:
                self.node.remove(rec.id)
                out.append(rec.id)
            except NotFoundError:
                pass
        return out

    def reattach(self, name: str) -> dict[str, Any]:
        """A trainer coming back: its lease renewed, sandboxes that a dead process left
        frozen (a snapshot in progress) thawed unless the job is parked, orphans removed."""
        out = self.renew(name)
        if not out["parked"]:
            for r in self._live_rollouts(name):
                try:
                    rec = self.node.lookup(r["sandbox"])
                    b = self.node.backend(rec.backend)
                    is_paused = getattr(b, "is_paused", None)
                    if rec.status == "running" and is_paused and is_paused(
                            self.node.handle_of(rec)):
                        b.resume(self.node.handle_of(rec))
                except Exception as e:
                    log.warning("job %s: sandbox %s: %s", name, r["sandbox"], e)
        self.collect_orphans(name)
        return self.get(name)

    def _rollout_row(self, rid: str) -> sqlite3.Row:
        if not isinstance(rid, str) or not rid or not all(c.isalnum() or c in "-_"
                                                            for c in rid):
            raise UsageError(f"invalid rollout id {rid!r}")
        rows = self.db.q("SELECT * FROM rollouts WHERE id=? OR sandbox=?", (rid, rid))
        if not rows:
            rows = self.db.q("SELECT * FROM rollouts WHERE id LIKE ? OR sandbox LIKE ?",
                             (rid + "%", rid + "%"))
            if len(rows) > 1:
                raise UsageError(f"rollout id {rid!r} is ambiguous")
        if not rows:
            raise NotFoundError(f"no rollout or job sandbox {rid!r} on this node",
                                hint="list a job's rollouts with `dsec job ls NAME`")
        return rows[0]

    def _set_rollout(self, rid: str, **cols: Any) -> None:
        sets = ", ".join(f"{k}=?" for k in cols)
        with self.db.tx() as db:
            db.execute(f"UPDATE rollouts SET {sets} WHERE id=?", (*cols.values(), rid))

    def rollout(self, rid: str) -> dict[str, Any]:
        r = self._rollout_row(rid)
        steps = self.db.q("SELECT count(*) AS n, max(step) AS last FROM steps WHERE rollout=? "
                          "AND state='done'", (r["id"],))[0]
        alive = False
        if r["sandbox"]:
            try:
                rec = self.node.lookup(r["sandbox"])
                alive = rec.status in ("running", "paused", "parked") and \
                    self.node.backend(rec.backend).is_alive(self.node.handle_of(rec))
            except NotFoundError:
                alive = False
        return {"id": r["id"], "job": r["job"], "sandbox": r["sandbox"], "image": r["image"],
                "backend": json.loads(r["opts"]).get("backend", "container"),
                "group": r["grp"], "index": r["idx"], "status": r["status"], "alive": alive,
                "steps": steps["n"], "last_step": steps["last"] or 0,
                "snapshot_step": r["snap_step"], "snapshot_image": r["snap_image"],
                "ticket": r["ticket"], "grades": self.grades(r["id"])}

    def rollouts(self, name: str) -> list[dict[str, Any]]:
        self._job(name)
        return [self.rollout(r["id"]) for r in self.db.q(
            "SELECT id FROM rollouts WHERE job=? ORDER BY created, idx", (name,))]

    def release(self, rid: str) -> dict[str, Any]:
        """Remove a rollout's sandbox and free its slot; its journal stays with the job."""
        r = self._rollout_row(rid)
        if r["sandbox"]:
            try:
                self.node.remove(r["sandbox"])
            except NotFoundError:
                pass
        self._set_rollout(r["id"], sandbox=None, status="released")
        if r["ticket"]:
            self.release_slot(r["ticket"])
        return self.rollout(r["id"])

    # -- grades ----------------------------------------------------------------------------------
    def record_grade(self, sandbox_id: str, result: dict[str, Any]) -> dict[str, Any] | None:
        """Journal a grade of ``sandbox_id`` (a GradeResult's dict) with the trajectory of
        the rollout that owns the sandbox, durably; None when no rollout owns it."""
        rows = self.db.q("SELECT id FROM rollouts WHERE sandbox=?", (sandbox_id,))
        if not rows:
            return None
        rid = rows[0]["id"]
        tests = result.get("tests") or []
        n_passed = sum(1 for t in tests if t.get("outcome") == "passed")
        doc = {k: v for k, v in result.items() if k != "log"}
        with self.db.tx() as db:
            seq = db.execute("SELECT coalesce(max(seq), 0) + 1 FROM grades WHERE rollout=?",
                             (rid,)).fetchone()[0]
            after = db.execute("SELECT coalesce(max(step), 0) FROM steps WHERE rollout=? "
                               "AND state='done'", (rid,)).fetchone()[0]
            db.execute("INSERT INTO grades VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                       (rid, seq, after, sandbox_id, str(result.get("grader", "")),
                        float(result.get("reward") or 0.0), int(bool(result.get("passed"))),
                        n_passed, len(tests) - n_passed, int(bool(result.get("tampered"))),
                        str(result.get("infra_error") or ""), json.dumps(doc, sort_keys=True),
                        float(result.get("finished") or time.time())))
        return self.grades(rid)[-1]

    def grades(self, rid: str) -> list[dict[str, Any]]:
        """A rollout's grades in order: reward, pass/fail counts, tamper and infra flags."""
        return [{"kind": "grade", "grade": g["seq"], "after_step": g["after_step"],
                 "sandbox": g["sandbox"], "grader": g["grader"], "reward": g["reward"],
                 "passed": bool(g["passed"]), "tests_passed": g["tests_passed"],
                 "tests_failed": g["tests_failed"], "tampered": bool(g["tampered"]),
                 "infra_error": g["infra_error"], "finished": g["finished"],
                 "result": json.loads(g["result"])}
                for g in self.db.q("SELECT * FROM grades WHERE rollout=? ORDER BY seq", (rid,))]

    # -- the journal ---------------------------------------------------------------------------
    def _digest(self, r: sqlite3.Row) -> str | None:
        """The rollout's writable-state digest, where the node sees its writes (a backend
        whose overlay upper dir is on the host: `Backend.upper_on_host`); None elsewhere."""
        if not r["sandbox"]:
            return None
        try:
            rec = self.node.lookup(r["sandbox"])
        except NotFoundError:
            return None
        upper = self.node.sandboxes_dir / rec.id / "upper"
        if not backend_class(rec.backend).upper_on_host or not upper.is_dir():
            return None
        layers = [Path(p) for p in rec.layers]
        base = layers[:r["base_layers"]]
        return state_digest(layers[r["base_layers"]:], upper, base)

    def journal(self, rid: str, output: bool = True) -> list[dict[str, Any]]:
        r = self._rollout_row(rid)
        return [self._step_doc(s, output) for s in self.db.q(
            "SELECT * FROM steps WHERE rollout=? ORDER BY step", (r["id"],))]

    @staticmethod
    def _step_doc(s: sqlite3.Row, output: bool = True) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "step": s["step"], "key": s["key"], "argv": json.loads(s["argv"]), "cwd": s["cwd"],
            "env": json.loads(s["env"]), "stdin_digest": s["stdin_digest"], "state": s["state"],
            "digest_before": s["before"], "digest_after": s["after"], "started": s["started"],
            "duration": s["duration"]}
        doc.update(json.loads(s["result"]) if s["result"] else {})
        if output:
            doc["stdout"] = bytes(s["stdout"] or b"")
            doc["stderr"] = bytes(s["stderr"] or b"")
        return doc

    @staticmethod
    def _result(s: sqlite3.Row) -> ExecResult:
        doc = json.loads(s["result"])
        return ExecResult(stdout=bytes(s["stdout"] or b""), stderr=bytes(s["stderr"] or b""),
                          **doc)

    def exec(self, rid: str, argv: list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | None = None, timeout: float | None = None,
             key: str | None = None, capture_limit: int | None = None
             ) -> tuple[ExecResult, dict[str, Any]]:
        """Run one journaled step; with ``key``, at most once. Returns the result and the
        step's facts (``step``, ``from_journal``)."""
        env = dict(env or {})
        started = self.begin_step(rid, argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout,
                                  key=key)
        if isinstance(started, tuple):
            return started
        try:
            res = self.node.exec(started.sandbox, argv, env=env, cwd=cwd, stdin=stdin,
                                 timeout=timeout, capture_limit=capture_limit)
        except BaseException:
            self.abort_step(started)
            raise
        return res, self.end_step(started, res)

    def begin_step(self, rid: str, argv: list[str], *, env: dict[str, str],
                   cwd: str | None = None, stdin: bytes | None = None,
                   timeout: float | None = None, key: str | None = None, wait: bool = True
                   ) -> Step | tuple[ExecResult, dict[str, Any]]:
        """The journal's half of an exec before its command runs: a keyed step already done
        is served (its result and facts); otherwise the step is written as ``running`` and
        returned, for the caller to run its command and then `end_step` or `abort_step`.
        A keyed step running in a live process is waited for, or with ``wait=False``
        raises `StepRunning` (the caller waits in its own way and asks again)."""
        check_key(key)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise UsageError("exec needs a command (a list of strings)")
        r = self._rollout_row(rid)
        if key is not None:
            served = self._keyed(r, key, wait)
            if served is not None:
                return served
            r = self._rollout_row(r["id"])
        if r["status"] != "live" or not r["sandbox"]:
            raise SandboxError(f"rollout {r['id']} has no live sandbox ({r['status']})",
                               hint=f"rebuild it with `dsec replay {r['id']}`")
        before = self._digest(r)
        t0 = time.time()
        try:
            step = self._begin(r["id"], key, argv, cwd, env, stdin, timeout, before, t0)
        except sqlite3.IntegrityError:  # another thread took this key first: its result
            if key is None:
                raise
            return self.begin_step(rid, argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout,
                                   key=key, wait=wait)
        return Step(r["id"], step, r["sandbox"], t0)

    def abort_step(self, s: Step) -> None:
        """The step's command did not run to completion: it is not a step."""
        try:
            with self.db.tx() as db:
                db.execute("DELETE FROM steps WHERE rollout=? AND step=?", (s.rollout, s.step))
        finally:
            with self._running_lock:
                self._running.discard((s.rollout, s.step))

    def end_step(self, s: Step, res: ExecResult) -> dict[str, Any]:
        """Commit a step with its result (and snapshot the rollout when one is due)."""
        try:
            after = self._digest(self._rollout_row(s.rollout))
            with self.db.tx() as db:
                db.execute("UPDATE steps SET state='done', result=?, stdout=?, stderr=?, "
                           "after=?, duration=? WHERE rollout=? AND step=?",
                           (_result_doc(res), res.stdout, res.stderr, after,
                            time.time() - s.t0, s.rollout, s.step))
        finally:
            # only once the step is done: a thread waiting on its key must never see it
            # ``running`` and no longer run by anyone (it would take it for interrupted)
            with self._running_lock:
                self._running.discard((s.rollout, s.step))
        self._maybe_snapshot(s.rollout, s.step)
        return {"step": s.step, "from_journal": False, "rollout": s.rollout,
                "sandbox": s.sandbox}

    def _begin(self, rid: str, key: str | None, argv: list[str], cwd: str | None,
               env: dict[str, str], stdin: bytes | None, timeout: float | None,
               before: str | None, t0: float) -> int:
        """Write a step as ``running`` (before its command starts); its number."""
        pid, start = _owner()
        # not fsynced: a power loss that drops this row also stopped the sandbox, whose
        # rollout is then rebuilt from its committed steps anyway
        with self._running_lock, self.db.tx(durable=False) as db:
            step = db.execute("SELECT coalesce(max(step), 0) + 1 FROM steps WHERE rollout=?",
                              (rid,)).fetchone()[0]
            db.execute("INSERT INTO steps (rollout, step, key, argv, cwd, env, stdin, "
                       "stdin_digest, timeout, state, before, started, owner_pid, owner_start) "
                       "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                       (rid, step, key, json.dumps(argv), cwd, json.dumps(env), stdin,
                        hashlib.sha256(stdin).hexdigest() if stdin is not None else None,
                        timeout, "running", before, t0, pid, start))
            self._running.add((rid, step))
        return int(step)

    def _keyed(self, r: sqlite3.Row, key: str,
               wait: bool = True) -> tuple[ExecResult, dict[str, Any]] | None:
        """A step with this key: its journaled result, after waiting for a running one; or
        None when it must run (never ran, or was interrupted without changing the state)."""
        deadline = time.monotonic() + 24 * 3600
        while True:
            rows = self.db.q("SELECT * FROM steps WHERE rollout=? AND key=?", (r["id"], key))
            if not rows:
                return None
            s = rows[0]
            if s["state"] == "done":
                return self._result(s), {"step": s["step"], "from_journal": True,
                                         "rollout": r["id"],
                                         "sandbox": self._rollout_row(r["id"])["sandbox"]}
            if self._elsewhere(s):
                if not wait:
                    raise StepRunning(f"step {s['step']} of rollout {r['id']} is running")
                if time.monotonic() > deadline:
                    raise SandboxError(f"step {s['step']} of rollout {r['id']} is still running")
                time.sleep(0.05)  # another process runs it now: serve its result
                continue
            self._recover_interrupted(r["id"])
            return None

    def _recover_interrupted(self, rid: str) -> None:
        """Steps left ``running`` by a dead process: dropped where the state is unchanged,
        else the rollout is rebuilt to its last committed step."""
        r = self._rollout_row(rid)
        stale = [s for s in self.db.q("SELECT * FROM steps WHERE rollout=? AND "
                                      "state='running' ORDER BY step", (rid,))
                 if not self._elsewhere(s)]
        if not stale:
            return
        now_digest = self._digest(r) if r["sandbox"] else None
        unchanged = r["status"] == "live" and now_digest is not None and \
            now_digest == stale[0]["before"]
        if not unchanged:
            log.info("rollout %s: an interrupted step may have changed the sandbox: rebuilding",
                     rid)
            self.replay(rid)
        with self.db.tx() as db:
            db.executemany("DELETE FROM steps WHERE rollout=? AND step=? AND state='running'",
                           [(rid, s["step"]) for s in stale])

    # -- snapshots and replay ------------------------------------------------------------------
    def _maybe_snapshot(self, rid: str, step: int) -> None:
        r = self._rollout_row(rid)
        j = self._job(r["job"])
        due_steps = j["snapshot_steps"] and step - r["snap_step"] >= j["snapshot_steps"]
        due_time = j["snapshot_seconds"] and time.time() - r["snap_time"] >= j["snapshot_seconds"]
        if (due_steps or due_time) and step > r["snap_step"]:
            self.snapshot(rid)

    def snapshot(self, rid: str) -> dict[str, Any] | None:
        """Snapshot the rollout's state at its last committed step (as a layer and an image
        ``job-NAME-ROLLOUT@sSTEP`` in the node's store). None where the backend cannot."""
        r = self._rollout_row(rid)
        if not r["sandbox"]:
            return None
        rec = self.node.lookup(r["sandbox"])
        if not self.node.backend(rec.backend).supports_snapshot or \
                not rec.spec.get("from_store"):
            self._set_rollout(rid, snap_time=time.time())
            return None
        step = self.db.q("SELECT coalesce(max(step), 0) AS s FROM steps WHERE rollout=? AND "
                         "state='done'", (rid,))[0]["s"]
        ref = f"job-{r['job']}-{rid}@s{step}"
        out = self.node.snapshot(rec.id, ref)
        old = r["snap_image"]
        self._set_rollout(rid, snap_step=step, snap_image=ref, snap_time=time.time())
        if old and old != ref:
            self._remove_snapshots(r["job"], [old])
        return out

    def replay(self, rid: str) -> dict[str, Any]:
        """Rebuild a rollout in a fresh sandbox: its image plus its last snapshot, then the
        committed steps after that snapshot re-executed in order, each checked against its
        recorded state digests. The journal keeps its results."""
        r = self._rollout_row(rid)
        j = self._job(r["job"])
        if r["status"] == "released":
            raise UsageError(f"rollout {r['id']} was released")
        for old in self._tagged(r["job"]):  # its sandbox, and any a dead replay left
            if old.spec["env"][TAG] == r["id"]:
                try:
                    self.node.remove(old.id)
                except NotFoundError:
                    pass
        self._set_rollout(r["id"], sandbox=None, status="lost")
        rec = self._create(r["id"], j, r["snap_image"] or r["image"], json.loads(r["opts"]))
        if not r["snap_image"]:
            self._set_rollout(r["id"], base_layers=len(rec.layers))
        r = self._rollout_row(r["id"])
        try:
            for s in self.db.q("SELECT * FROM steps WHERE rollout=? AND state='done' AND "
                               "step>? ORDER BY step", (r["id"], r["snap_step"])):
                self._check(r, s, "before", s["before"])
                self.node.exec(rec.id, json.loads(s["argv"]), env=json.loads(s["env"]),
                               cwd=s["cwd"], stdin=s["stdin"], timeout=s["timeout"],
                               capture_limit=0)
                self._check(r, s, "after", s["after"])
        except BaseException:
            self.node.remove(rec.id)
            self._set_rollout(r["id"], sandbox=None, status="lost")
            raise
        self._set_rollout(r["id"], status="live")
        return self.rollout(r["id"])

    def _check(self, r: sqlite3.Row, s: sqlite3.Row, when: str, want: str | None) -> None:
        if want is None:
            return
        got = self._digest(r)
        if got is not None and got != want:
            raise SandboxError(
                f"replay of rollout {r['id']} diverged {when} step {s['step']}: state digest "
                f"{got} differs from the journal's {want}",
                hint="the step's command is not deterministic (time, randomness, network)")

    # -- the lease, applied by node gc ---------------------------------------------------------
    def sweep(self, dry_run: bool = False) -> dict[str, Any]:
        """Apply every job's lease: park past the park grace, reclaim past the reclaim grace,
        forget past the retention; drop queue tickets of dead processes; mark rollouts whose
        sandbox is gone as lost."""
        report: dict[str, list[str]] = {"parked": [], "reclaimed": [], "forgotten": [],
                                        "lost": []}
        t = time.time()
        # tickets of dead processes: queued ones, and held ones no rollout took up
        for s in self.db.q("SELECT ticket, owner_pid, owner_start FROM slots WHERE "
                           "(state='queued' OR ticket NOT IN (SELECT ticket FROM rollouts "
                           "WHERE ticket IS NOT NULL))"):
            if not _rootfs.alive(s["owner_pid"], s["owner_start"]) and not dry_run:
                self.release_slot(s["ticket"])
        for j in self.db.q("SELECT * FROM jobs"):
            name, over = j["name"], t - j["expires"]
            if j["reclaimed"] is not None:
                if t - j["reclaimed"] >= j["retain"]:
                    report["forgotten"].append(name)
                    if not dry_run:
                        self.remove(name)
                continue
            if not dry_run:
                self.collect_orphans(name)
            if over >= j["reclaim_grace"]:
                report["reclaimed"].append(name)
                if not dry_run:
                    self._remove_sandboxes(name, "lost")
                    with self.db.tx() as db:
                        db.execute("UPDATE jobs SET reclaimed=? WHERE name=?", (t, name))
                        db.execute("DELETE FROM slots WHERE job=?", (name,))
                    if j["retain"] <= 0:
                        report["forgotten"].append(name)
                        self.remove(name)
            elif over >= j["park_grace"] and not j["parked"]:
                report["parked"].append(name)
                if not dry_run:
                    self.park(name, by_lease=True)
        for r in self.db.q("SELECT id, sandbox FROM rollouts WHERE status='live' AND "
                           "sandbox IS NOT NULL"):
            if self.node.db.get(r["sandbox"]) is None:
                report["lost"].append(r["id"])
                if not dry_run:
                    self._set_rollout(r["id"], sandbox=None, status="lost")
        return report


_jobs: dict[str, NodeJobs] = {}
_jobs_lock = threading.Lock()


def node_jobs(node: Node) -> NodeJobs:
    """The process-wide jobs of a node."""
    with _jobs_lock:
        j = _jobs.get(str(node.root))
        if j is None or j.node is not node:
            j = _jobs[str(node.root)] = NodeJobs(node)
        return j
