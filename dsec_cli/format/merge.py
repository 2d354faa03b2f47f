"""Stacking layers: the merged view of several indexes, bottom to top, with whiteouts and
opaque directories applied exactly as overlayfs would show them."""

from __future__ import annotations

from dataclasses import replace

from .index import Entry, LayerIndex


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def merge(indexes: list[LayerIndex]) -> list[tuple[Entry, int]]:
    """(entry, layer number) for every visible path, sorted by path; no whiteouts remain."""
    merged: dict[str, tuple[Entry, int]] = {}
    for n, index in enumerate(indexes):
        hidden = {e.path for e in index.entries if e.type == "whiteout"}
        hidden_below = {e.path for e in index.entries if e.type == "dir" and e.opaque}
        if hidden or hidden_below:
            for path in list(merged):
                if path in hidden or any(a in hidden or a in hidden_below
                                         for a in _ancestors(path)):
                    del merged[path]
        for e in index.entries:
            if e.type == "whiteout":
                continue
            below = merged.get(e.path)
            if below is not None and below[0].type == "dir" and e.type != "dir":
                # a file replacing a directory hides everything under it
                prefix = e.path + "/"
                for path in [p for p in merged if p.startswith(prefix)]:
                    del merged[path]
            merged[e.path] = (e, n)
    by_layer = [{e.path: e for e in ix.entries} for ix in indexes]
    out = []
    for path in sorted(merged):
        e, n = merged[path]
        if e.type == "hard":
            target = merged.get(e.target)
            if target is None or target[1] != n or target[0].type != "reg":
                # the inode's first name was replaced above: keep the bytes as a plain file
                src = by_layer[n][e.target]
                e = replace(src, path=e.path)
        out.append((e, n))
    return out
