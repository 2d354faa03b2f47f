"""The job database: ``jobs.db`` beside the node database (sqlite WAL, ``synchronous=FULL``:
a committed step survives a crash of the trainer or the node), its schema, a job's settings,
the checks on job names and idempotency keys, and the step a running command is journaled as."""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...backends import _rootfs
from ...backends.base import ExecResult
from ...core import validate
from ...core.errors import SandboxError, UsageError
from ...core.sqlite import immediate, thread_connection

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


def owner() -> tuple[int, int | None]:
    return os.getpid(), _rootfs.proc_start_time(os.getpid())


def result_doc(res: ExecResult) -> str:
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
