"""This host's density facilities (`dsec node check --host`) and their set-up
(`dsec node setup`): swap, KSM, cgroup v1/v2 controllers. Park, thaw and top are sandbox
operations (api/sandboxes.py). docs/density.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core import validate
from ..run import density

__all__ = ["host_facts", "setup_node"]


def host_facts() -> dict[str, Any]:
    """Swap, KSM, the cgroup version of each controller, how memory is reclaimed, and a
    note for each missing facility saying what dsec does without it."""
    return density.host_facts()


def setup_node(swap: str | int | None = None, swap_file: str | Path | None = None,
               ksm: bool | None = None, ksm_pages: int | None = None) -> dict[str, Any]:
    """Add a swap file of ``swap`` bytes (e.g. "8G") at ``swap_file``, switch KSM on or off
    and set its pages scanned per wake-up; returns what the host offers afterwards."""
    size = None if swap is None else swap if isinstance(swap, int) \
        else validate.size(swap, "--swap")
    validate.positive_int(ksm_pages, "--ksm-pages")
    return density.setup(size, Path(swap_file) if swap_file else None, ksm, ksm_pages)
