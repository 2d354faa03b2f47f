"""A grade of a sandbox owned by a job is journaled with that rollout's trajectory, in the
job's database: after the step it followed, with its reward, pass/fail counts, tamper flag and
infrastructure error; `dsec journal`, the rollout's info and a resumed job all show it, and
removing the job removes it."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_cli.api import grading
from dsec_cli.api.jobs import Job
from dsec_cli.api.sandboxes import Sandbox

from .conftest import GOLD, GRADER, TASK

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
              pytest.mark.usefixtures("grade_home")]


def _dsec(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "dsec_cli", *argv], capture_output=True,
                       text=True, env={**os.environ, **env}, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


def test_job_sandbox_grades_join_its_trajectory(grade_env: dict[str, str], node) -> None:
    job = Job.start("graded", ttl=600)
    try:
        ro = job.sandbox(TASK, "container")
        sid = ro.sandbox_id
        assert sid
        ro.write_file("/testbed/calc.py", GOLD, key="patch")
        gold = grading.grade(sid, GRADER)
        assert gold.reward == 1.0 and gold.infra_error == "", gold.log
        # a second turn edits a protected test file: graded again, flagged
        ro.exec("echo '# edited' >> /testbed/tests/test_calc.py", key="tamper")
        tampered = grading.grade(sid, GRADER)
        assert tampered.tampered

        # the hidden tests still pass (the test file is not taken), the reward is flagged
        assert tampered.reward == 1.0 and tampered.passed, tampered.log
        want = [(1, 1, 1.0, True, 3, 0, False, ""), (2, 2, 1.0, True, 3, 0, True, "")]

        def summary(grades: list[dict]) -> list[tuple]:
            return [(g["grade"], g["after_step"], g["reward"], g["passed"], g["tests_passed"],
                     g["tests_failed"], g["tampered"], g["infra_error"]) for g in grades]

        grades = ro.grades()
        assert summary(grades) == want
        assert grades[0]["result"]["grader"] == GRADER and grades[0]["sandbox"] == sid
        assert [t["outcome"] for t in grades[0]["result"]["tests"]] == ["passed"] * 3
        assert "tests/test_calc.py" in json.dumps(grades[1]["result"]["tamper"])
        # the rollout's journal of steps is unchanged by grading
        assert [s["key"] for s in ro.journal()] == ["patch", "tamper"]

        # another process: `dsec journal` (json and table) and a resumed job read them back
        doc = json.loads(_dsec(grade_env, "journal", ro.id, "--json").stdout)
        assert [d.get("key") for d in doc if d.get("kind") != "grade"] == ["patch", "tamper"]
        assert summary([d for d in doc if d.get("kind") == "grade"]) == want
        table = _dsec(grade_env, "journal", sid).stdout  # piped: plain columns, 3+ spaces apart
        rows = [re.split(r" {3,}", line.strip()) for line in table.splitlines()
                if GRADER in line]
        assert [r[:7] for r in rows] == [["1", "1", GRADER, "1", "3", "0", "no"],
                                         ["2", "2", GRADER, "1", "3", "0", "yes"]], table
        job.close()
        resumed = Job.resume("graded")
        try:
            [again] = resumed.rollouts()
            assert summary(again.info()["grades"]) == want
        finally:
            resumed.close()
        db = sqlite3.connect(Path(grade_env["DSEC_STATE_DIR"]) / "jobs.db")
        try:
            assert db.execute("SELECT count(*) FROM grades WHERE rollout=?",
                              (ro.id,)).fetchone()[0] == 2
        finally:
            db.close()
    finally:
        job.remove()
    # the job's rows go with it, its grades too
    db = sqlite3.connect(Path(grade_env["DSEC_STATE_DIR"]) / "jobs.db")
    try:
        assert db.execute("SELECT count(*) FROM grades").fetchone()[0] == 0
    finally:
        db.close()


def test_grade_of_a_sandbox_no_job_owns_is_not_in_any_rollout(grade_env: dict[str, str]
                                                              ) -> None:
    job = Job.start("bystander", ttl=600)
    try:
        ro = job.sandbox(TASK, "container")
        with Sandbox(TASK) as sb:
            sb.write_file("/testbed/calc.py", GOLD)
            assert sb.grade(GRADER).reward == 1.0
        assert ro.grades() == []
    finally:
        job.remove()
