"""Cluster: the nodes in the user's config (add, list, check, remove), placement over them,
per-node fan-outs, and the node service each node runs for `dsec --node` (what `dsec node ...`,
`dsec agent` and `dsec gc --all-nodes` call)."""

from __future__ import annotations

from typing import Any

from ..core import validate
from ..core.errors import UsageError
from ..run.cluster.api import NodeResult, create_many, gc_all, node_status, ps_all
from ..run.cluster.placement import NodeView, Placer
from ..run.cluster.registry import add_node, load_nodes, remove_node

__all__ = ["NodeResult", "NodeView", "Placer", "add_node", "check_nodes", "create_many",
           "gc_all", "gc_nodes", "list_nodes", "load_nodes", "node_status", "ps_all", "remove_node",
           "serve_node"]


def list_nodes(timeout: float | None = None, names: list[str] | None = None
               ) -> list[NodeResult]:
    """Every (or the named) node's reachability, version, capacity, usage and cached bytes,
    asked in parallel."""
    validate.positive_float(timeout, "--timeout")
    for name in names or []:
        validate.node_name(name)
    return node_status(timeout, names)


def check_nodes(names: list[str] | None = None, timeout: float | None = None
                ) -> list[NodeResult]:
    """As `list_nodes` for the named nodes (default: all configured ones)."""
    return list_nodes(timeout, names or list(load_nodes()) or None)


def serve_node(stdio: bool = False, listen: str | None = None,
               state_dir: str | None = None, *, resident: bool = False) -> dict[str, Any] | None:
    """Serve this node to the cluster (the node service `dsec agent` runs), on stdin/stdout
    (over ssh) or on a unix socket; or, with ``resident``, make sure the node's long-lived
    service runs and return where it listens."""
    from ..run.cluster import node_service

    if stdio + bool(listen) + resident != 1:
        raise UsageError("give exactly one of --stdio, --listen PATH or --resident")
    if resident:
        from ..run.cluster import resident as resident_service

        return resident_service.ensure(state_dir)
    if stdio:
        node_service.serve_stdio(state_dir)
    else:
        assert listen
        node_service.serve_unix(listen, state_dir)
    return None


def gc_nodes(budget: int | str | None = None, dry_run: bool = False) -> list[NodeResult]:
    """`gc_node` on every configured node, in parallel; a node that fails is reported."""
    n = None if budget is None else budget if isinstance(budget, int) \
        else validate.size(budget, "--budget")
    return gc_all(n, dry_run)
