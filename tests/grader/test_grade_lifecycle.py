"""Grading's walls beyond the exploit suite: a grade killed midway leaves nothing once
reconciled, the tamper audit compares against the recorded task start, the command line's
output and exit codes, and bad graders or tasks refused before anything is made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import UsageError
from dsec_cli.run.grade import reconcile_grading

from .conftest import GOLD, GRADER, TASK

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
              pytest.mark.usefixtures("grade_home")]


def _dsec(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-c", "from dsec_cli.cli import main; main()", *args],
                       capture_output=True, text=True, timeout=600)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def test_grade_killed_midway_leaves_nothing_after_reconcile(node: Any) -> None:
    with Sandbox(TASK) as sb:
        sb.write_file("/testbed/calc.py", "def add(a, b):\n    while True:\n        pass\n")
        before = {r.id for r in node.db.all()}
        proc = subprocess.Popen([sys.executable, "-c", "from dsec_cli.cli import main; main()",
                                 "grade", sb.id, "--grader", GRADER],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            forks: set[str] = set()
            while time.monotonic() < deadline and not forks:
                forks = {r.id for r in node.db.all()} - before
                time.sleep(0.2)
            assert forks, "no scoring fork appeared"
            fork = next(iter(forks))
            # wait until the grader's command runs in the fork, then kill the grading
            deadline = time.monotonic() + 120
            running = False
            while time.monotonic() < deadline and not running:
                try:
                    r = node.exec(fork, ["/bin/sh", "-c", "ps | grep -c '[p]ytest'"],
                                  timeout=30)
                except UsageError:  # the fork is still being created
                    r = None
                running = r is not None and r.stdout.strip() not in (b"", b"0")
                time.sleep(0.2)
            assert running, "the grader's command never started in the fork"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert fork in {r.id for r in node.db.all()}  # left behind by the kill
        assert reconcile_grading(node) == [fork]
        assert {r.id for r in node.db.all()} == before
        assert not list((Path(node.root) / "grading").glob("*.json"))
        assert sb.exec("echo alive").stdout == b"alive\n"  # not left paused
        assert node.lookup(sb.id).status == "running"


def test_tamper_audit_against_the_recorded_start(node: Any) -> None:
    with Sandbox(TASK) as sb:
        # setup before the agent starts may change protected files: not the agent's doing
        sb.write_file("/testbed/tests/test_setup.py", "def test_setup():\n    pass\n")
        assert sb.start_task()["protected"] >= 2
        sb.write_file("/testbed/calc.py", GOLD)
        clean = sb.grade(GRADER)
        assert clean.reward == 1.0 and not clean.tampered, clean.tamper
        sb.write_file("/testbed/tests/test_setup.py", "def test_setup():\n    assert 1\n")
        sb.exec("rm /testbed/tests/test_calc.py")
        sb.write_file("/testbed/tests/conftest.py", "")
        result = sb.grade(GRADER)
        assert result.reward == 1.0  # the fix is still the fix: tampering is flagged
        assert result.tamper == {"changed": ["testbed/tests/test_setup.py"],
                                 "created": ["testbed/tests/conftest.py"],
                                 "deleted": ["testbed/tests/test_calc.py"]}
        assert result.tampered


def test_cli_grade_and_journal(node: Any) -> None:
    with Sandbox(TASK) as sb:
        sb.write_file("/testbed/calc.py", GOLD)
        sb.write_file("/testbed/conftest.py", "")
        doc = json.loads(_dsec("grade", sb.id, "--grader", GRADER, "--json").stdout)
        assert doc["reward"] == 1.0 and doc["tampered"]
        assert {t["outcome"] for t in doc["tests"]} == {"passed"}
        text = _dsec("grade", sb.id, "--grader", GRADER).stdout
        assert "passed   test_add\n" in text
        assert "dropped  testbed/conftest.py" in text and "reward 1" in text
    lines = (Path(node.root) / "grading" / "journal.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["sandbox"] == sb.id


def test_bad_graders_and_tasks_are_refused(node: Any) -> None:
    with Sandbox(TASK) as sb:
        before = {r.id for r in node.db.all()}
        for grader, message in ((TASK, "not a grader image"),
                                ("busybox@1.35-1", "not a grader image"),
                                ("no-such@1", "no-such")):
            with pytest.raises(UsageError, match=message):
                sb.grade(grader)
        bad = _dsec("grade", sb.id, "--grader", "x@@1", check=2)
        assert "x@@1" in bad.stderr
        assert {r.id for r in node.db.all()} == before
    with Sandbox("busybox@1.35-1") as other:
        with pytest.raises(UsageError, match="declares no task"):
            other.grade(GRADER)
