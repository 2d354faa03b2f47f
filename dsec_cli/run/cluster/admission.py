"""A node's capacity and the admission of new sandboxes against it.

Two clients may create on one node at once, each through its own `dsec agent` process, so
admission is decided under a cross-process lock: a write transaction (``BEGIN IMMEDIATE``) on
``<state dir>/admission.db``. Inside it the node service adds up what the node already holds
(the node database's live sandboxes plus the reservations of creates still in progress) and
either records a reservation for the new sandbox or refuses. A reservation carries the id the
sandbox will have and counts only until a live row of that id exists; it is dropped after the
create returns (or failed), so a sandbox is counted exactly once, however many creates one
node service process runs at once. Reservations of a dead
node service process (pid gone) are ignored and pruned.

Capacity comes from ``<state dir>/capacity.yaml`` (keys ``sandboxes``, ``cpus``, ``memory``,
``cpu_overcommit``, ``memory_overcommit``); missing keys default to the machine: its CPUs, its
RAM, one sandbox per 10 MiB of RAM, and ratios of 1. A sandbox without ``--cpus``/``--memory``
counts only against the sandbox count.

Overcommit (docs/density.md): declared CPUs of ``batch`` sandboxes may add up to ``cpus``
times ``cpu_overcommit``, while ``latency`` ones never add up past ``cpus`` (their exec answers
must stay fast) and ``idle`` ones do not count. Declared memory may add up to ``memory`` times
``memory_overcommit``, and, whatever is declared, the memory the node's sandboxes actually hold
now (resident, after reclaim) plus the new sandbox's declared memory over that ratio must fit
in ``memory``.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...backends import _rootfs
from ...core.config import read_config_file
from ...core.errors import ConfigError
from ...core.sqlite import immediate, thread_connection
from ...core.units import parse_size
from ..density import resident_total
from ..node import Node
from .errors import CapacityError

#: rows that hold capacity; a warm pool member counts once, as ``pooled`` and then as the
#: running sandbox it becomes (a create served from a pool reserves nothing)
LIVE = ("creating", "running", "paused", "parked", "pooled")


@dataclass
class Capacity:
    sandboxes: int
    cpus: float
    memory: int
    cpu_overcommit: float = 1.0
    memory_overcommit: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Usage:
    sandboxes: int = 0
    cpus: float = 0.0  # declared, idle-class sandboxes left out
    memory: int = 0  # declared
    latency_cpus: float = 0.0  # declared by latency-class sandboxes (part of cpus)
    resident: int = 0  # bytes the node's sandboxes hold in RAM now

    def add(self, cpus: float | None, memory: int | None, cpu_class: str | None = None
            ) -> None:
        self.sandboxes += 1
        if cpu_class != "idle":
            self.cpus += cpus or 0.0
        if cpu_class == "latency":
            self.latency_cpus += cpus or 0.0
        self.memory += memory or 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def load_capacity(state_dir: Path) -> Capacity:
    mem, cpus = mem_total(), float(os.cpu_count() or 1)
    cap = Capacity(sandboxes=max(1, mem // (10 << 20)), cpus=cpus, memory=mem)
    path = state_dir / "capacity.yaml"
    if path.is_file():
        data = read_config_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping")
        for key, value in data.items():
            if key == "sandboxes" and isinstance(value, int) and value >= 0:
                cap.sandboxes = value
            elif key == "cpus" and isinstance(value, int | float) and value > 0:
                cap.cpus = float(value)
            elif key == "memory" and isinstance(value, int | str):
                cap.memory = parse_size(str(value), f"{path}: memory")
            elif key in ("cpu_overcommit", "memory_overcommit") and \
                    isinstance(value, int | float) and not isinstance(value, bool) and \
                    1 <= value <= 1000:
                setattr(cap, key, float(value))
            else:
                raise ConfigError(f"{path}: invalid key or value {key!r}: {value!r}",
                                  hint="keys: sandboxes (int), cpus (number), memory (e.g. 64G), "
                                       "cpu_overcommit and memory_overcommit (1 to 1000)")
    return cap


class Admission:
    """Capacity accounting for one node state dir (shared by every node service process on it)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.path = node.root / "admission.db"
        self._local = threading.local()
        db = self._db()
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS reservations (token TEXT PRIMARY KEY, "
                   "pid INTEGER, start INTEGER, cpus REAL, memory INTEGER, created REAL, "
                   "cpu_class TEXT)")
        cols = {r[1] for r in db.execute("PRAGMA table_info(reservations)")}
        if "cpu_class" not in cols:  # a table made before CPU classes
            db.execute("ALTER TABLE reservations ADD COLUMN cpu_class TEXT")

    def _db(self) -> sqlite3.Connection:
        # reservations need no durability: after a crash their owners are dead, and dead
        # owners' reservations are ignored; only the lock (the write transaction) matters
        return thread_connection(self._local, "adm", self.path, ("synchronous=OFF",))

    @contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        with immediate(self._db()) as db:
            yield db

    def _node_db(self) -> sqlite3.Connection:
        """A read connection to the node database, one per thread."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.node.db.path, timeout=60, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA busy_timeout=60000")
            self._local.db = db
        return db

    def capacity(self) -> Capacity:
        return load_capacity(self.node.root)

    def _usage(self, db: sqlite3.Connection) -> Usage:
        u = Usage()
        held = []
        stale = []
        for token, pid, start, cpus, memory, cpu_class in db.execute(
                "SELECT token, pid, start, cpus, memory, cpu_class FROM reservations"):
            if _rootfs.alive(pid, start):
                held.append((token, cpus, memory, cpu_class))
            else:
                stale.append((token,))
        # summed inside sqlite (JSON1): decoding every row in Python would cost milliseconds
        # per create on a node holding thousands of sandboxes
        cls = "json_extract(spec, '$.limits.cpu_class')"
        cpu = "json_extract(spec, '$.limits.cpus')"
        live = f"status IN ({','.join('?' * len(LIVE))})"
        ndb = self._node_db()
        # one read snapshot for both queries: a sandbox row written between two reads would
        # be missed by the sum and still hide its reservation, counting it zero times
        ndb.execute("BEGIN")
        try:
            n, cpus, memory, latency = ndb.execute(
                f"SELECT count(*), total(CASE WHEN {cls} = 'idle' THEN 0 ELSE {cpu} END), "
                "total(json_extract(spec, '$.limits.memory')), "
                f"total(CASE WHEN {cls} = 'latency' THEN {cpu} ELSE 0 END) FROM sandboxes "
                f"WHERE {live}", LIVE).fetchone()
            # a reservation is named by the id of the sandbox it admits: once that sandbox's
            # row exists the row is what counts, so a create in flight is counted once
            tokens = [t for t, _, _, _ in held]
            rows = {r[0] for r in ndb.execute(
                f"SELECT id FROM sandboxes WHERE id IN ({','.join('?' * len(tokens))}) "
                f"AND {live}", (*tokens, *LIVE))} if tokens else set()
        finally:
            ndb.execute("COMMIT")
        u.sandboxes, u.cpus, u.memory = int(n), float(cpus), int(memory)
        u.latency_cpus = float(latency)
        u.resident = resident_total(self.node)
        for token, cpus, memory, cpu_class in held:
            if token not in rows:
                u.add(cpus, memory, cpu_class)
        if stale:
            db.executemany("DELETE FROM reservations WHERE token=?", stale)
        return u

    def usage(self) -> Usage:
        with self._locked() as db:
            return self._usage(db)

    def reserve(self, cpus: float | None, memory: int | None, cpu_class: str | None = None,
                token: str | None = None) -> str:
        """Admit one sandbox or raise CapacityError; returns the reservation token, the id
        the sandbox will have (``token``, or a new one)."""
        cap = self.capacity()
        with self._locked() as db:
            u = self._usage(db)
            short = []
            if u.sandboxes + 1 > cap.sandboxes:
                short.append(f"sandboxes {u.sandboxes}/{cap.sandboxes}")
            cpu_cap = cap.cpus * cap.cpu_overcommit
            if cpus and cpu_class != "idle" and u.cpus + cpus > cpu_cap + 1e-9:
                short.append(f"cpus {u.cpus:g}+{cpus:g} > {cpu_cap:g}")
            if cpus and cpu_class == "latency" and u.latency_cpus + cpus > cap.cpus + 1e-9:
                short.append(f"latency cpus {u.latency_cpus:g}+{cpus:g} > {cap.cpus:g}")
            mem_cap = int(cap.memory * cap.memory_overcommit)
            if memory and u.memory + memory > mem_cap:
                short.append(f"memory {u.memory}+{memory} > {mem_cap}")
            # a new sandbox is expected to hold its declared memory over the ratio
            expect = int(memory / cap.memory_overcommit) if memory else 0
            if memory and u.resident + expect > cap.memory:
                short.append(f"resident memory {u.resident}+{expect} > {cap.memory}")
            if short:
                raise CapacityError("node is full: " + ", ".join(short),
                                    hint="place with --node auto, or remove sandboxes")
            token = token or secrets.token_hex(6)
            pid = os.getpid()
            db.execute("INSERT INTO reservations VALUES (?,?,?,?,?,?,?)",
                       (token, pid, _rootfs.proc_start_time(pid), cpus, memory, time.time(),
                        cpu_class))
            return token

    def admit_member(self, opts: Any) -> Any:
        """The pools' admission hook: a warm pool member is made only where a sandbox could
        be; returns its release."""
        token = self.reserve(opts.cpus, opts.memory, opts.cpu_class)
        return lambda: self.release(token)

    def release(self, token: str) -> None:
        with self._locked() as db:
            db.execute("DELETE FROM reservations WHERE token=?", (token,))
