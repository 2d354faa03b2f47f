"""Snapshots and replay: a rollout's writable state saved as a layer every K steps or T seconds
(deduplicated against its image), and a rollout rebuilt from its image plus its last snapshot
by running the journaled steps after it again, each checked against its recorded state
digest."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from ...core.errors import NotFoundError, SandboxError, UsageError
from .lease import Leases
from .store import TAG


class Replay(Leases):
    """Snapshots and replay of a node's rollouts."""

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
