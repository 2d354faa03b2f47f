"""Warm pools of this node (`dsec pool`): list them, keep a pool of a given size, make what
they lack now, drain them. See `dsec_cli.run.pool` for what a pool member is.

    from dsec_cli.api.pools import set_pool
    set_pool("busybox@1.35-1", 4, memory="64M")   # later creates with memory=64M take one
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run.node import finish_pool_refills, local_node
from ..run.pool import parse_size_arg
from .options import create_options

__all__ = ["list_pools", "set_pool", "drain_pools", "fill_pools", "finish_refills"]


def list_pools(state_dir: str | Path | None = None) -> dict[str, Any]:
    """The node's pools (size, target, ready and creating members) and the pool settings."""
    node = local_node(state_dir)
    return {"pools": node.pools.status(), "settings": node.pools.settings_dict()}


def set_pool(image: str, size: int | str | None, backend: str = "container", *,
             cpus: float | None = None, memory: int | str | None = None,
             pids: int | None = None, disk: int | str | None = None, network: str = "none",
             env: dict[str, str] | None = None, workdir: str | None = None, fill: bool = True,
             state_dir: str | Path | None = None, prefix: str = "") -> dict[str, Any]:
    """Keep ``size`` members (``"auto"``: learned from creations) of sandboxes created with
    exactly these options; with ``fill`` they are made before this returns."""
    opts = create_options(backend, cpus=cpus, memory=memory, pids=pids, network=network,
                          env=env, workdir=workdir, disk=disk, prefix=prefix)
    return local_node(state_dir).pools.set(image, opts, parse_size_arg(size), fill)


def fill_pools(state_dir: str | Path | None = None) -> int:
    """Make every member the pools lack now (waiting for a refiller at work); how many."""
    return local_node(state_dir).pools.refill(block=True)


def drain_pools(key: str | None = None, state_dir: str | Path | None = None) -> list[str]:
    """Stop keeping the pools (all, or the one whose key starts with ``key``) and remove
    their ready members; the ids removed."""
    return local_node(state_dir).pools.drain(key)


def finish_refills() -> None:
    """Make the pool members this process's creates took, and stop refilling until the next
    take (a long-lived process serving short commands calls it after each)."""
    finish_pool_refills()
