"""Which node a sandbox call goes to: a ``NODE/ID`` sandbox id or ``node=NAME`` is that
cluster node, anything else this machine. `sandboxes`, `aio`, `grading` and `images` route
through `target` and nowhere else."""

from __future__ import annotations

from pathlib import Path

from ..core import validate
from ..run.contract import NodeAPI
from ..run.node import local_node

__all__ = ["target"]


def target(sandbox_id: str | None = None, node: str | None = None,
           state_dir: str | Path | None = None, store: str | None = None) -> NodeAPI:
    """The node holding a sandbox (named in a ``NODE/ID`` id, or by ``node``), or this one."""
    validate.node_option(node, "--node")
    if sandbox_id is not None:
        validate.sandbox_id(sandbox_id)
    if node or (sandbox_id and "/" in sandbox_id):
        from ..run.cluster.api import node_for

        return node_for(sandbox_id, node, state_dir)
    return local_node(state_dir, store)
