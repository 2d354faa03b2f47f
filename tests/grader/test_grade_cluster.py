"""Grading a cluster node's sandbox (``NODE/ID``): the grade runs on that node (its fork is
made, run and removed there), by the SDK and by `dsec grade`; `start-task` and `dsec egress`
reach the node the same way. The node is real: sshd on a loopback port running this
checkout's `dsec agent` (tests/cluster/sshnodes.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.backends import egress
from tests.cluster.sshnodes import SshCluster, destroy_cluster, make_cluster

from .conftest import GOLD, GRADER, TASK

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes and sshd need root")


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory, grade_store: str,
             grade_data: Path) -> Iterator[SshCluster]:
    c = make_cluster(tmp_path_factory.mktemp("gcluster"), grade_store, grade_data, 1)
    try:
        yield c
    finally:
        destroy_cluster(c)


@pytest.fixture
def client(one_node: SshCluster, monkeypatch: pytest.MonkeyPatch,
           dsec_home: Path) -> Iterator[SshCluster]:
    """This test's user config lists the node; nothing is left on it afterwards."""
    for k, v in one_node.client_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DSEC_STORE", one_node.store_url)
    from dsec_cli.core.config import save_user_config

    save_user_config({"nodes": one_node.config_nodes()})
    yield one_node
    from dsec_cli.run.node import Node

    n = one_node.nodes[0]
    left = [r.id for r in Node(n.state_dir, one_node.store_url).db.all()]
    assert left == [], f"sandboxes left on the node: {left}"


def _node_ids(c: SshCluster) -> set[str]:
    from dsec_cli.run.node import Node

    return {r.id for r in Node(c.nodes[0].state_dir, c.store_url).db.all()}


def test_sdk_grades_a_cluster_sandbox_on_its_node(client: SshCluster) -> None:
    with Sandbox(TASK, node="node1") as sb:
        assert sb.id.startswith("node1/")
        assert sb.start_task()["sandbox"] == sb.id
        sb.write_file("/testbed/calc.py", GOLD)
        result = sb.grade(GRADER)
        assert result.infra_error == "", result.infra_error
        assert result.reward == 1.0 and result.passed, result.log
        assert [t.outcome for t in result.tests] == ["passed"] * 3
        assert result.sandbox == sb.id and result.fork.startswith("node1/")
        assert not result.tampered
        # the fork was made and removed on the node: only the agent's sandbox is there
        assert _node_ids(client) == {sb.id.split("/", 1)[1]}
        # journaled on the node, beside its sandboxes
        journal = client.nodes[0].state_dir / "grading" / "journal.jsonl"
        assert json.loads(journal.read_text().splitlines()[-1])["reward"] == 1.0


def _dsec(*argv: str) -> subprocess.CompletedProcess[str]:
    code = "import sys\nfrom dsec_cli.cli import main\nsys.argv = ['dsec', *sys.argv[1:]]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=600)


def test_cli_grades_and_changes_egress_on_the_node(client: SshCluster) -> None:
    with Sandbox(TASK, node="node1", network="allowlist", egress=["host:9"]) as sb:
        p = _dsec("grade", sb.id, "--grader", GRADER, "--json")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["sandbox"] == sb.id and out["reward"] == 0.0 and out["infra_error"] == ""
        assert {t["outcome"] for t in out["tests"]} == {"failed"}
        # the node's filter changes (it is this machine's: the chain is visible here)
        p = _dsec("egress", sb.id, "host:10", "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["rules"] == ["host:10"]
        chain = egress.names(sb.id.split("/", 1)[1])["chain"]
        rules = subprocess.run(["iptables", "-w", "-S", chain], capture_output=True,
                               text=True).stdout
        assert "--dport 10 " in rules + " " and "--dport 9 " not in rules + " "
        assert sb.info()["egress"]["rules"] == ["host:10"]
        bad = _dsec("egress", sb.id, "bad_name.test:80")
        assert bad.returncode == 2 and "bad_name.test:80" in bad.stderr
        assert _node_ids(client) == {sb.id.split("/", 1)[1]}


def test_client_killed_midway_the_node_finishes_and_removes_the_fork(
        client: SshCluster) -> None:
    """The grade is the node's work: a client killed once the fork exists does not stop it;
    the node scores, journals and removes the fork, leaving no marker."""
    state = client.nodes[0].state_dir
    journal = state / "grading" / "journal.jsonl"
    with Sandbox(TASK, node="node1") as sb:
        local = sb.id.split("/", 1)[1]
        sb.write_file("/testbed/calc.py", GOLD)
        graded = len(journal.read_text().splitlines()) if journal.exists() else 0
        code = "import sys\nfrom dsec_cli.cli import main\nsys.argv = ['dsec', *sys.argv[1:]]\n" \
               "main()\n"
        proc = subprocess.Popen([sys.executable, "-c", code, "grade", sb.id, "--grader", GRADER],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and _node_ids(client) == {local}:
                assert proc.poll() is None, "the grade ended before its fork was seen"
                time.sleep(0.1)
            assert _node_ids(client) != {local}, "no scoring fork appeared on the node"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (
                _node_ids(client) != {local} or list((state / "grading").glob("*.json"))):
            time.sleep(0.5)
        assert _node_ids(client) == {local}  # the fork is gone
        assert not list((state / "grading").glob("*.json"))  # no grade left unfinished
        lines = journal.read_text().splitlines()
        assert len(lines) == graded + 1 and json.loads(lines[-1])["reward"] == 1.0
        assert sb.exec("echo alive").stdout == b"alive\n"  # not left paused
