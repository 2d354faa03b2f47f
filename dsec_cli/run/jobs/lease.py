"""A job's lease: started and renewed by its trainer, reattached to after a restart; parked by
hand or, past ``park_grace`` after it expired, by `sweep` (node gc); past ``reclaim_grace``
its sandboxes are removed and its rollouts lost; past ``retain`` more its rows and snapshot
refs go too."""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...backends import _rootfs
from ...core.errors import NotFoundError, SandboxError, UsageError
from .rollouts import Rollouts
from .store import JobSettings, check_name

log = logging.getLogger(__name__)


class Leases(Rollouts):
    """The leases of a node's jobs."""

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
