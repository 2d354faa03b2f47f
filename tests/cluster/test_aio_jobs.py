"""An `AsyncJob` whose group spans the three sshd nodes: each member's execs are journaled
on its node over the loop's session to it (a keyed exec is served from there), a resumed
async trainer finds the rollouts on every node, and removing the job leaves no sandbox on
any node."""

from __future__ import annotations

import asyncio
from collections import Counter

from dsec_cli.api.aio import close_sessions
from dsec_cli.api.aio_jobs import AsyncJob

from .conftest import IMAGE
from .sshnodes import SshCluster


def _node_sandboxes() -> dict[str, int]:
    from dsec_cli.run.cluster.registry import get_node

    return {name: len(get_node(name).sandboxes()) for name in ("node1", "node2", "node3")}


def test_async_group_across_nodes_is_journaled_resumed_and_removed(client: SshCluster) -> None:
    async def main() -> None:
        job = await AsyncJob.start("aspread", ttl=120)
        try:
            g = await job.group(4, IMAGE, "fncall", node="auto")
            assert [m.status for m in g.members] == ["ok"] * 4, [m.error for m in g.members]
            nodes = Counter(m.rollout.node for m in g.members if m.rollout)
            assert set(nodes) <= {"node1", "node2", "node3"}, nodes

            async def turn(m):  # type: ignore[no-untyped-def]
                cmd = ["sh", "-c", f"echo {m.index} >> /tmp/i; cat /tmp/i"]
                first = await m.rollout.exec(cmd, key="turn-1")
                again = await m.rollout.exec(cmd, key="turn-1")  # served: runs nothing
                assert first.stdout == again.stdout == f"{m.index}\n".encode()
                assert (await m.rollout.read_file("/tmp/i")) == f"{m.index}\n".encode()

            await asyncio.gather(*(turn(m) for m in g.members))
            await job.close()
            resumed = await AsyncJob.resume("aspread", heartbeat=False)
            rollouts = await resumed.rollouts()
            assert Counter(r.node for r in rollouts) == nodes
            for ro in rollouts:
                steps = await ro.journal()
                assert [s["key"] for s in steps] == ["turn-1"]
                assert steps[0]["stdout"] == f"{(await ro.info())['index']}\n".encode()
            bad = await resumed.group(2, IMAGE, "fncall", node="node1", memory="1000T")
            assert [m.status for m in bad.members] == ["infra_failure"] * 2
            await resumed.remove()
        finally:
            await job.close()
            try:
                await job.remove()
            except Exception:  # removed above
                pass
            await close_sessions()

    asyncio.run(main())
    assert _node_sandboxes() == {"node1": 0, "node2": 0, "node3": 0}
