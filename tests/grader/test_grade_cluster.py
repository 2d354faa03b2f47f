"""Grading a cluster node's sandbox (``NODE/ID``): the grade runs on that node (its fork is
made, run and removed there), by the SDK and by `dsec grade`; `start-task` and `dsec egress`
reach the node the same way. The node is real: sshd on a loopback port running this
checkout's `dsec agent` (tests/cluster/sshnodes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
        bad = _dsec("egress", sb.id, "example.com:80")
        assert bad.returncode == 2 and "example.com:80" in bad.stderr
        assert _node_ids(client) == {sb.id.split("/", 1)[1]}
