"""Routing is decided once, in dsec_cli.api.sandboxes: a plain id stays on this machine, a
NODE/ID id or --node NAME goes to that cluster node, and --node auto only places new
sandboxes. Bad input is refused before any node is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec_cli.api import sandboxes
from dsec_cli.core.errors import DsecError, UsageError
from dsec_cli.run.cluster.remote import RemoteNode
from dsec_cli.run.contract import NodeAPI
from dsec_cli.run.node import Node


def test_a_plain_id_routes_to_this_node(tmp_path: Path) -> None:
    target = sandboxes.target("abc123", state_dir=tmp_path / "state")
    assert isinstance(target, Node) and isinstance(target, NodeAPI)
    assert target.root == (tmp_path / "state").absolute()


def test_a_node_qualified_id_routes_to_that_node() -> None:
    from dsec_cli.api.cluster import add_node

    add_node("node1", "root@127.0.0.1:2222", check=False)  # saved, not reached
    target = sandboxes.target("node1/abc123")
    assert isinstance(target, RemoteNode) and target.name == "node1"
    assert isinstance(target, NodeAPI)
    assert isinstance(sandboxes.target(None, node="node1"), RemoteNode)


def test_an_unknown_node_is_a_clear_error() -> None:
    with pytest.raises(DsecError, match="nowhere"):
        sandboxes.target("nowhere/abc123")


def test_auto_places_new_sandboxes_only() -> None:
    with pytest.raises(UsageError, match="auto only places new sandboxes"):
        sandboxes.target("abc123", node="auto")


def test_a_sandbox_on_another_node_than_named_is_refused() -> None:
    with pytest.raises(UsageError, match="is on node 'node1', not 'node2'"):
        sandboxes.target("node1/abc123", node="node2")


@pytest.mark.parametrize("kwargs, needle", [
    ({"memory": "lots"}, "--memory"),
    ({"ttl": "soon"}, "--ttl"),
    ({"cpus": -1.0}, "--cpus"),
    ({"pids": 0}, "--pids"),
])
def test_create_options_name_the_flag(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        sandboxes.create_options("container", prefix="--", **kwargs)  # type: ignore[arg-type]
