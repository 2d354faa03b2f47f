"""The node database: sandboxes, the layer leases they hold and the image pins that keep store
gc from deleting what runs here. sqlite in WAL mode, one short transaction per change, so many
dsec processes (and threads) on one node can create and remove sandboxes at once and the state
survives crashes and restarts.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.sqlite import immediate, thread_connection

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    backend TEXT NOT NULL,
    image TEXT NOT NULL,
    image_digest TEXT NOT NULL,
    status TEXT NOT NULL,           -- creating | running | paused | parked | dead | pooled
    handle TEXT,                    -- the backend's JSON state, once created
    spec TEXT NOT NULL,             -- limits, network, env, workdir, layers (JSON)
    created REAL NOT NULL,
    expires REAL,                   -- NULL: no TTL
    owner_pid INTEGER,              -- the process creating it (reconcile: dead owner = crash)
    owner_start INTEGER
);
CREATE TABLE IF NOT EXISTS leases (   -- cached layer dirs a sandbox's rootfs stacks
    sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    layer TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, layer)
);
CREATE TABLE IF NOT EXISTS pins (     -- manifest digests store gc must keep
    sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    digest TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, digest)
);
CREATE TABLE IF NOT EXISTS pools (    -- warm pools kept on this node (pool.py)
    key TEXT PRIMARY KEY,
    image TEXT NOT NULL,            -- the reference it was asked for by (for display)
    digest TEXT NOT NULL,           -- the image manifest digest members are made from
    options TEXT NOT NULL,          -- the create options that make the key (JSON)
    size INTEGER,                   -- fixed size (dsec pool set); NULL: learned from demand
    recent TEXT NOT NULL,           -- recent creation times of the key (JSON list)
    last REAL NOT NULL              -- the key's last creation
);
-- a create takes the oldest member of its pool without reading every row (pool.py)
CREATE INDEX IF NOT EXISTS sandboxes_pooled ON sandboxes (json_extract(spec, '$.pool'), created)
    WHERE status = 'pooled';
"""


@dataclass
class SandboxRecord:
    id: str
    backend: str
    image: str
    image_digest: str
    status: str
    handle: dict[str, Any] | None
    spec: dict[str, Any]
    created: float
    expires: float | None
    owner_pid: int | None = None
    owner_start: int | None = None
    layers: list[str] = field(default_factory=list)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "backend": self.backend, "image": self.image,
                "image_digest": self.image_digest, "status": self.status,
                "created": self.created, "expires": self.expires,
                "limits": self.spec.get("limits", {}), "network": self.spec.get("network"),
                "workdir": self.spec.get("workdir", "/")}


class NodeDB:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        path.parent.mkdir(parents=True, exist_ok=True)
        db = self._connect()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        st = path.stat()
        self._ident = (st.st_dev, st.st_ino)

    def same_file(self) -> bool:
        """Whether ``path`` is still the database this object opened (a state dir removed
        and made again holds a new one)."""
        try:
            st = self.path.stat()
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def _connect(self) -> sqlite3.Connection:
        return thread_connection(self._local, "db", self.path,
                                 ("foreign_keys=ON", "synchronous=NORMAL"))

    def read(self) -> sqlite3.Connection:
        """This thread's connection, for reads outside a write transaction."""
        return self._connect()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with immediate(self._connect()) as db:
            yield db

    def insert(self, r: SandboxRecord, pins: list[str]) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (r.id, r.backend, r.image, r.image_digest, r.status,
                        json.dumps(r.handle) if r.handle is not None else None,
                        json.dumps(r.spec), r.created, r.expires, r.owner_pid, r.owner_start))
            db.executemany("INSERT OR IGNORE INTO leases VALUES (?,?)",
                           [(r.id, layer) for layer in r.layers])
            db.executemany("INSERT OR IGNORE INTO pins VALUES (?,?)", [(r.id, d) for d in pins])

    def update(self, sid: str, *, status: str | None = None,
               handle: dict[str, Any] | None = None) -> None:
        with self.tx() as db:
            if status is not None:
                db.execute("UPDATE sandboxes SET status=? WHERE id=?", (status, sid))
            if handle is not None:
                db.execute("UPDATE sandboxes SET handle=? WHERE id=?", (json.dumps(handle), sid))

    def delete(self, sid: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM sandboxes WHERE id=?", (sid,))

    def _rows(self, where: str = "", args: tuple[Any, ...] = ()) -> list[SandboxRecord]:
        db = self._connect()
        rows = db.execute(f"SELECT * FROM sandboxes {where} ORDER BY created", args).fetchall()
        leases: dict[str, list[str]] = {}
        # one row (a lookup, a take) reads its own leases, not every sandbox's; in the order
        # they were written (the layer stack's order: an index would give them sorted)
        lease_rows = db.execute("SELECT sandbox_id, layer FROM leases WHERE sandbox_id=? "
                                "ORDER BY rowid", (rows[0][0],)) if len(rows) == 1 else \
            db.execute("SELECT sandbox_id, layer FROM leases ORDER BY rowid")
        for sid, layer in lease_rows:
            leases.setdefault(sid, []).append(layer)
        return [SandboxRecord(r[0], r[1], r[2], r[3], r[4],
                              json.loads(r[5]) if r[5] else None, json.loads(r[6]), r[7], r[8],
                              r[9], r[10], leases.get(r[0], [])) for r in rows]

    def all(self) -> list[SandboxRecord]:
        return self._rows()

    def get(self, sid: str) -> SandboxRecord | None:
        rows = self._rows("WHERE id=?", (sid,))
        return rows[0] if rows else None

    def find(self, prefix: str) -> list[SandboxRecord]:
        return self._rows("WHERE id LIKE ?", (prefix.replace("%", "") + "%",))

    def leased_layers(self) -> set[str]:
        return {r[0] for r in self._connect().execute("SELECT DISTINCT layer FROM leases")}

    def pins(self) -> set[str]:
        return {r[0] for r in self._connect().execute("SELECT DISTINCT digest FROM pins")}


def now() -> float:
    return time.time()
