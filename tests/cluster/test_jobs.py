"""A job whose group spans the three sshd nodes: members placed as create_many places them,
each exec journaled on its node (keyed execs served from there), a resumed trainer finds the
rollouts on every node, a member no node can make is an infrastructure failure, and removing
the job leaves no sandbox on any node."""

from __future__ import annotations

import json
from collections import Counter

from dsec_cli.api.jobs import Job

from .conftest import IMAGE
from .sshnodes import SshCluster


def _node_sandboxes() -> dict[str, int]:
    from dsec_cli.run.cluster.registry import get_node

    return {name: len(get_node(name).sandboxes()) for name in ("node1", "node2", "node3")}


def test_group_across_nodes_is_journaled_resumed_and_removed(client: SshCluster,
                                                             run_dsec) -> None:  # type: ignore[no-untyped-def]
    job = Job.start("spread", ttl=120)
    try:
        g = job.group(6, IMAGE, "fncall", node="auto")
        assert [m.status for m in g.members] == ["ok"] * 6, [m.error for m in g.members]
        nodes = Counter(m.rollout.node for m in g.members if m.rollout)
        assert set(nodes) <= {"node1", "node2", "node3"}, nodes  # placed as create_many
        for m in g.members:
            assert m.rollout is not None
            first = m.rollout.exec(["sh", "-c", f"echo {m.index} > /tmp/i; cat /tmp/i"],
                                   key="turn-1")
            again = m.rollout.exec(["sh", "-c", "echo again > /tmp/i"], key="turn-1")
            assert first.stdout == again.stdout == f"{m.index}\n".encode()
            assert m.rollout.exec(["cat", "/tmp/i"]).stdout == f"{m.index}\n".encode()
        job.close()
        resumed = Job.resume("spread", heartbeat=False)
        rollouts = resumed.rollouts()
        assert Counter(r.node for r in rollouts) == nodes
        for ro in rollouts:
            steps = ro.journal()
            assert [s["key"] for s in steps] == ["turn-1", None]
            assert steps[0]["stdout"] == f"{ro.info()['index']}\n".encode()
        ro = rollouts[0]
        doc = json.loads(run_dsec("journal", f"{ro.node}/{ro.id}", "--json").stdout)
        assert [s["key"] for s in doc] == ["turn-1", None]
        rebuilt = json.loads(run_dsec("replay", f"{ro.node}/{ro.id}", "--json").stdout)
        assert rebuilt["alive"] and rebuilt["sandbox"] != ro.sandbox_id
        # parked and pre-warmed on every node at once: each answers again
        resumed.park()
        warm = resumed.rollouts()
        assert Counter(r.node for r in warm) == nodes
        assert resumed.prewarm().result(timeout=120)["parked"] is False
        for r in warm:
            assert r.exec(["cat", "/tmp/i"]).stdout == f"{r.info()['index']}\n".encode()
        # a group on a node that cannot take it: every member reported, none raised
        bad = resumed.group(2, IMAGE, "fncall", node="node1", memory="1000T")
        assert [m.status for m in bad.members] == ["infra_failure"] * 2
        assert all(m.error for m in bad.members)
        resumed.remove()
    finally:
        job.close()
        try:
            job.remove()
        except Exception:  # removed above
            pass
    assert _node_sandboxes() == {"node1": 0, "node2": 0, "node3": 0}
