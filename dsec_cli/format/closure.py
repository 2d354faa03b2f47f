"""The objects a manifest reaches, in commit order (packs, indexes, layer manifests,
image manifests), so that copying them in order never publishes a dangling reference."""

from __future__ import annotations

from typing import Any

from ..core.digests import object_key
from .manifest import Manifest, load_manifest


def closure(store: Any, manifest_digest: str) -> list[str]:
    """Keys of every object reachable from a manifest, dependencies first."""
    packs: dict[str, None] = {}
    indexes: dict[str, None] = {}
    manifests: dict[str, None] = {}
    _walk(store, manifest_digest, packs, indexes, manifests, {})
    return ([object_key("packs", d) for d in packs] + [object_key("indexes", d) for d in indexes]
            + [object_key("manifests", d) for d in manifests])


def _walk(store: Any, digest: str, packs: dict[str, None], indexes: dict[str, None],
          manifests: dict[str, None], seen: dict[str, Manifest]) -> None:
    if digest in seen:
        return
    m = load_manifest(store, digest)
    seen[digest] = m
    # `base` is provenance only: a layer's content does not need the base it was built on
    for child in m.layers:
        _walk(store, child, packs, indexes, manifests, seen)
    for p in m.packs:
        packs.setdefault(p)
    if m.index:
        indexes.setdefault(m.index)
    manifests.setdefault(digest)
