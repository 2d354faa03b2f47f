"""Placement over three real nodes (capacities 20, 40, 60): batches spread by capacity, a
node that caches the image is preferred, two clients creating at once never oversubscribe a
node. Sandboxes use the cheap fncall backend."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dsec_cli.run.cluster.placement import NodeView, Placer

from .conftest import IMAGE, TINY
from .sshnodes import SshCluster


def _remove_all(results: list) -> None:  # type: ignore[type-arg]
    for r in results:
        if r.ok:
            r.sandbox.remove()


def _usage(name: str) -> int:
    from dsec_cli.run.cluster.registry import get_node

    return int(get_node(name).info()["usage"]["sandboxes"])


def test_placer_spreads_by_capacity_and_prefers_cache() -> None:
    views = [NodeView("a", 10, 4, 1 << 30), NodeView("b", 20, 4, 1 << 30),
             NodeView("c", 30, 4, 1 << 30)]
    p = Placer(views)
    got = Counter(p.place("img") for _ in range(30))
    assert got == {"a": 5, "b": 10, "c": 15}
    assert p.place("img", cpus=5) is None  # fits nowhere: 4 cpus per node
    q = Placer([NodeView("big", 100, 4, 1 << 30),
                NodeView("small", 20, 4, 1 << 30, images={"img": (100, 100)})])
    assert q.place("img") == "small"  # the cached image outweighs the free slots
    full = Placer([NodeView("f", 1, 4, 1 << 30, used_sandboxes=1)])
    assert full.place("img") is None


def test_create_many_spreads_60_over_3_nodes(client: SshCluster) -> None:
    from dsec_cli.api.sandboxes import create_many

    results = create_many(60, IMAGE, "fncall", parallel=6)
    try:
        assert all(r.ok for r in results), [str(r.error) for r in results if not r.ok][:3]
        per_node = Counter(r.node for r in results)
        # proportional to capacity 20:40:60 -> 10:20:30 (one either way at the edges)
        for name, want in (("node1", 10), ("node2", 20), ("node3", 30)):
            assert abs(per_node[name] - want) <= 1, per_node
            assert _usage(name) == per_node[name]
        assert all(r.sandbox.id.startswith(f"{r.node}/") for r in results)
        r0 = results[0].sandbox
        assert r0.exec(["echo", "ok"]).stdout == b"ok\n"
    finally:
        _remove_all(results)
    assert all(_usage(n) == 0 for n in ("node1", "node2", "node3"))


def test_auto_prefers_the_node_that_caches_the_image(client: SshCluster) -> None:
    from dsec_cli.api.sandboxes import Sandbox
    from dsec_cli.run.cluster.registry import get_node

    assert [get_node(n).info(TINY)["image"]["cached_bytes"] for n in ("node1", "node2")] \
        == [0, 0]
    warm = Sandbox.create(TINY, "fncall", node="node1")  # node1 materializes the layer
    warm.remove()
    info = get_node("node1").info(TINY)["image"]
    assert info["cached_bytes"] == info["bytes"] > 0
    # every node is idle: without the cache node3 (most free slots) would win
    sb = Sandbox.create(TINY, "fncall", node="auto")
    try:
        assert sb.id.startswith("node1/")
    finally:
        sb.remove()
    other = Sandbox.create(IMAGE, "fncall", node="auto")  # cached everywhere: most room wins
    try:
        assert other.id.startswith("node3/")
    finally:
        other.remove()


CLIENT = """
import json, sys
from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import DsecError
from concurrent.futures import ThreadPoolExecutor
def one(_):
    try:
        return Sandbox.create(sys.argv[1], "fncall", node="node1").id
    except DsecError as e:
        return "refused: " + e.message
with ThreadPoolExecutor(4) as p:
    print(json.dumps(list(p.map(one, range(int(sys.argv[2]))))))
"""


def test_two_clients_do_not_oversubscribe(client: SshCluster, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    node1 = client.nodes[0]
    node1.set_capacity(sandboxes=5)
    try:
        env = {**os.environ}
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, IMAGE, "5"],
                                  stdout=subprocess.PIPE, env=env) for _ in range(2)]
        outs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
        made = [x for o in outs for x in o if not x.startswith("refused")]
        refused = [x for o in outs for x in o if x.startswith("refused")]
        assert len(made) == 5 and len(refused) == 5, outs
        assert all("node is full" in x for x in refused)
        assert _usage("node1") == 5
    finally:
        node1.set_capacity(sandboxes=20)
        from dsec_cli.api.sandboxes import Sandbox

        for sid in [x for o in outs for x in o if not x.startswith("refused")]:
            Sandbox.attach(sid).remove()
    assert _usage("node1") == 0


def test_fast_placer_decides_as_the_scan_does() -> None:
    import random

    from dsec_cli.run.cluster.placement import FastPlacer

    def views() -> list[NodeView]:
        r = random.Random(7)
        vs = [NodeView(f"n{i:02}", r.choice([5, 10, 40]), 8, 1 << 34) for i in range(24)]
        for v in vs:
            for j in r.sample(range(30), 5):
                v.images[f"i{j}"] = (100, r.choice([100, 100, 40]))
        return vs

    slow, fast = Placer(views()), FastPlacer(views())
    r = random.Random(3)
    for _ in range(500):
        image = f"i{r.randrange(40)}"
        assert slow.place(image) == fast.place(image)
    assert slow.place("i1") is None and fast.place("i1") is None  # full


def test_create_many_returns_failures_per_sandbox(client: SshCluster) -> None:
    from dsec_cli.api.sandboxes import create_many
    from dsec_cli.core.errors import NotFoundError, UsageError
    from dsec_cli.run.cluster.errors import CapacityError

    node1 = client.nodes[0]
    assert _usage("node1") == 0  # the client fixture: no other test's sandbox is there
    node1.set_capacity(sandboxes=2)
    results = []
    try:
        results = create_many(5, IMAGE, "fncall", nodes=["node1"], parallel=5)
        ok = [r for r in results if r.ok]
        errors = [r.error for r in results if not r.ok]
        # every sandbox gets a result; the node is filled and never oversubscribed
        assert [r.index for r in results] == [0, 1, 2, 3, 4]
        assert len(ok) == 2 and len(errors) == 3, errors
        assert all(isinstance(e, CapacityError) for e in errors), errors
        assert _usage("node1") == 2
    finally:
        node1.set_capacity(sandboxes=20)
        _remove_all(results)
    missing = create_many(2, "no-such-image@1", "fncall")
    assert [r.ok for r in missing] == [False, False]
    assert "no-such-image@1" in str(missing[0].error)
    assert isinstance(missing[0].error, NotFoundError)  # exit 2: bad input, not capacity
    with pytest.raises(UsageError, match="unknown node"):
        create_many(1, IMAGE, "fncall", nodes=["nope"])
