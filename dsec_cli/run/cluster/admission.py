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

Capacity comes from ``<state dir>/capacity.yaml`` (keys ``sandboxes``, ``cpus``, ``memory``);
missing keys default to the machine: its CPUs, its RAM, and one sandbox per 10 MiB of RAM.
A sandbox without ``--cpus``/``--memory`` counts only against the sandbox count.
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

import yaml

from ...backends import _rootfs
from ...core.config import parse_size
from ...core.errors import ConfigError
from ...core.sqlite import immediate, thread_connection
from ..node import Node
from .errors import CapacityError

#: rows that hold capacity; a warm pool member counts once, as ``pooled`` and then as the
#: running sandbox it becomes (a create served from a pool reserves nothing)
LIVE = ("creating", "running", "paused", "pooled")


@dataclass
class Capacity:
    sandboxes: int
    cpus: float
    memory: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Usage:
    sandboxes: int = 0
    cpus: float = 0.0
    memory: int = 0

    def add(self, cpus: float | None, memory: int | None) -> None:
        self.sandboxes += 1
        self.cpus += cpus or 0.0
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
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping")
        for key, value in data.items():
            if key == "sandboxes" and isinstance(value, int) and value >= 0:
                cap.sandboxes = value
            elif key == "cpus" and isinstance(value, int | float) and value > 0:
                cap.cpus = float(value)
            elif key == "memory" and isinstance(value, int | str):
                cap.memory = parse_size(str(value), f"{path}: memory")
            else:
                raise ConfigError(f"{path}: invalid key or value {key!r}: {value!r}",
                                  hint="keys: sandboxes (int), cpus (number), memory (e.g. 64G)")
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
                   "pid INTEGER, start INTEGER, cpus REAL, memory INTEGER, created REAL)")

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
        # summed inside sqlite (JSON1): decoding every row in Python would cost milliseconds
        # per create on a node holding thousands of sandboxes
        n, cpus, memory = self._node_db().execute(
            "SELECT count(*), total(json_extract(spec, '$.limits.cpus')), "
            "total(json_extract(spec, '$.limits.memory')) FROM sandboxes "
            f"WHERE status IN ({','.join('?' * len(LIVE))})", LIVE).fetchone()
        u.sandboxes, u.cpus, u.memory = int(n), float(cpus), int(memory)
        held = []
        stale = []
        for token, pid, start, cpus, memory in db.execute(
                "SELECT token, pid, start, cpus, memory FROM reservations"):
            if _rootfs.alive(pid, start):
                held.append((token, cpus, memory))
            else:
                stale.append((token,))
        if held:
            # a reservation is named by the id of the sandbox it admits: once that sandbox's
            # row exists the row is what counts, so a create in flight is counted once
            tokens = [t for t, _, _ in held]
            rows = {r[0] for r in self._node_db().execute(
                f"SELECT id FROM sandboxes WHERE id IN ({','.join('?' * len(tokens))}) "
                f"AND status IN ({','.join('?' * len(LIVE))})", (*tokens, *LIVE))}
            for token, cpus, memory in held:
                if token not in rows:
                    u.add(cpus, memory)
        if stale:
            db.executemany("DELETE FROM reservations WHERE token=?", stale)
        return u

    def usage(self) -> Usage:
        with self._locked() as db:
            return self._usage(db)

    def reserve(self, cpus: float | None, memory: int | None, token: str | None = None) -> str:
        """Admit one sandbox or raise CapacityError; returns the reservation token, the id
        the sandbox will have (``token``, or a new one)."""
        cap = self.capacity()
        with self._locked() as db:
            u = self._usage(db)
            short = []
            if u.sandboxes + 1 > cap.sandboxes:
                short.append(f"sandboxes {u.sandboxes}/{cap.sandboxes}")
            if cpus and u.cpus + cpus > cap.cpus + 1e-9:
                short.append(f"cpus {u.cpus:g}+{cpus:g} > {cap.cpus:g}")
            if memory and u.memory + memory > cap.memory:
                short.append(f"memory {u.memory}+{memory} > {cap.memory}")
            if short:
                raise CapacityError("node is full: " + ", ".join(short),
                                    hint="place with --node auto, or remove sandboxes")
            token = token or secrets.token_hex(6)
            pid = os.getpid()
            db.execute("INSERT INTO reservations VALUES (?,?,?,?,?,?)",
                       (token, pid, _rootfs.proc_start_time(pid), cpus, memory, time.time()))
            return token

    def admit_member(self, opts: Any) -> Any:
        """The pools' admission hook: a warm pool member is made only where a sandbox could
        be; returns its release."""
        token = self.reserve(opts.cpus, opts.memory)
        return lambda: self.release(token)

    def release(self, token: str) -> None:
        with self._locked() as db:
            db.execute("DELETE FROM reservations WHERE token=?", (token,))
