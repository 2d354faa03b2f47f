"""Scoring in a fork: a gold patch gets full reward, no patch gets none, the fork is gone
afterwards, and the hidden tests exist in no sandbox the agent reaches."""

from __future__ import annotations

import os

import pytest

from dsec_cli.api.sandboxes import Sandbox

from .conftest import GOLD, GRADER, TASK

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
              pytest.mark.usefixtures("grade_home")]


def test_gold_is_accepted_and_nothing_is_left(node) -> None:
    before = {r.id for r in node.db.all()}
    with Sandbox(TASK) as sb:
        sb.write_file("/testbed/calc.py", GOLD)
        result = sb.grade(GRADER)
        assert result.infra_error == ""
        assert result.reward == 1.0 and result.passed, result.log
        assert [t.outcome for t in result.tests] == ["passed"] * 3
        assert result.applied == ["testbed/calc.py"]
        assert not result.tampered
        assert {r.id for r in node.db.all()} == before | {sb.id}  # the fork is gone
        # the agent's sandbox holds no hidden test
        found = sb.exec("find / -xdev -name 'test_hidden*' -o -name 'oracle_calc*' "
                        "-o -name grader", timeout=120)
        assert found.exit_code == 0 and found.stdout == b""


def test_no_patch_gets_nothing() -> None:
    with Sandbox(TASK) as sb:
        result = sb.grade(GRADER)
        assert result.reward == 0.0 and not result.passed
        assert {t.outcome for t in result.tests} == {"failed"}


def test_hostile_names_and_many_files_do_not_stop_grading() -> None:
    with Sandbox(TASK) as sb:
        sb.write_file("/testbed/calc.py", GOLD)
        r = sb.exec("touch \"/testbed/$(printf '\\377')x.py\" && mkdir -p /tmp/many && "
                    "cd /tmp/many && i=0 && while [ $i -lt 2000 ]; do : > f$i; i=$((i+1)); "
                    "done", timeout=300)
        assert r.exit_code == 0, r.stderr
        result = sb.grade(GRADER)
        assert result.reward == 1.0, result.log
        assert {"path": "testbed/\\xffx.py", "why": "the name is not UTF-8"} in result.dropped
        assert len(result.dropped) == 1001  # bounded, the rest counted
        assert result.dropped[-1]["why"].endswith("more changes dropped")
