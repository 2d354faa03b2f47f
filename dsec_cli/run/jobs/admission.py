"""Admission slots: a job holds at most ``max_concurrent`` rollouts at once; requests past the
cap wait for a slot in ticket order, and the mean time a slot is held gives the queue's
estimate."""

from __future__ import annotations

import secrets
import time

from ...core.errors import NotFoundError
from .rows import JobRows
from .store import owner


class Admission(JobRows):
    """Admission slots of a node's jobs."""

    def acquire(self, name: str) -> str:
        """A ticket in the job's queue (admitted at once while under the cap)."""
        self._job(name)
        ticket = secrets.token_hex(8)
        pid, start = owner()
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
