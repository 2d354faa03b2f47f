"""The rows of one node's jobs that every part reads and writes: a job, its live rollouts, a
rollout's row, the sandboxes tagged with a rollout, a sandbox's state digest, and whether a
running step is still being run."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...backends import _rootfs, backend_class
from ...core.errors import NotFoundError, UsageError
from ..statedigest import state_digest
from .store import TAG, JobStore, check_name

if TYPE_CHECKING:
    from ..node import Node


class JobRows:
    """The rows every part of `NodeJobs` shares."""

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

    def _job(self, name: str) -> sqlite3.Row:
        check_name(name)
        rows = self.db.q("SELECT * FROM jobs WHERE name=?", (name,))
        if not rows:
            raise NotFoundError(f"no job {name!r} on this node", hint="list them with "
                                "`dsec job ls`")
        return rows[0]

    def _live_rollouts(self, name: str) -> list[sqlite3.Row]:
        return self.db.q("SELECT * FROM rollouts WHERE job=? AND status='live' "
                         "AND sandbox IS NOT NULL", (name,))

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

    def _tagged(self, name: str) -> list[Any]:
        """The node's sandboxes made for the job's rollouts (by their tag)."""
        rids = {r["id"] for r in self.db.q("SELECT id FROM rollouts WHERE job=?", (name,))}
        return [rec for rec in self.node.db.all()
                if (rec.spec.get("env") or {}).get(TAG) in rids]
