"""On-demand image loading: lazy layer mounts (FUSE) over the node's chunk cache, prefetch
lists and profiles. See docs/lazy.md."""

from __future__ import annotations

from .mount import FETCH_MODES, LazyMount, available, cleanup, mount_layers, read_stats, served_by

__all__ = ["FETCH_MODES", "LazyMount", "available", "cleanup", "mount_layers", "read_stats",
           "served_by"]
