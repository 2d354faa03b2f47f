"""Rollouts: the sandboxes of a job, each tagged with its rollout id so that orphans are found
again after a crash; their rows, grades and snapshot refs."""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import time
from typing import Any

from ...backends import _rootfs
from ...core.errors import NotFoundError, SandboxError
from ...format.refs import delete_ref
from ...push.stores.retrying import open_retrying
from ..options import CreateOptions
from .admission import Admission
from .store import TAG

log = logging.getLogger(__name__)


class Rollouts(Admission):
    """The rollouts of a node's jobs."""

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

    def _remove_snapshots(self, name: str, images: list[str]) -> None:
        """Snapshot refs (image and layer) of a removed job; store gc frees their packs."""
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
