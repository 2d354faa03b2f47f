"""The trajectory journal: every exec of a rollout is a step written as ``running`` before its
command starts and completed after, so a keyed step that is done returns its journaled
result, and one a dead trainer interrupted runs again only on the state it started from."""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from typing import Any

from ...backends.base import ExecResult
from ...core.errors import SandboxError, UsageError
from .replay import Replay
from .store import Step, StepRunning, check_key, owner, result_doc

log = logging.getLogger(__name__)


class Journal(Replay):
    """The step journal of a node's rollouts."""

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
                           (result_doc(res), res.stdout, res.stderr, after,
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
        pid, start = owner()
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
