"""Profiled prefetch (as eStargz's optimize): the files sandboxes of an image read in their
first seconds become the prefetch lists of new versions of its layers, so later lazy starts
fetch them in a few large reads before anything asks.

Profiles come from lazy mounts (`mount.save_profile`: one file per sandbox and layer under
``<node cache>/profiles/<layer content digest>/``, plus the live profile of running lazy
sandboxes). Only the index changes (its ``prefetch`` field), so a new layer version keeps the
content digest, packs and chunks of the old one: nothing is uploaded but an index and two
manifests.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.digests import object_key, parse_ref, sha256_hex
from ...core.errors import UsageError
from ...format.index import LayerIndex
from ...format.manifest import Manifest, put_manifest
from ...format.refs import commit_ref
from ...push.dedup import load_index
from ...push.materialize import resolve_image
from ...push.stores.base import Store

log = logging.getLogger(__name__)


@dataclass
class OptimizeResult:
    image: str
    image_digest: str
    layers: list[dict[str, Any]] = field(default_factory=list)

    def public(self) -> dict[str, Any]:
        return {"image": self.image, "image_digest": self.image_digest, "layers": self.layers}


def collect_profiles(node_root: Path) -> dict[str, list[dict[str, float]]]:
    """content digest -> per-run {path: first-read seconds}, saved and live."""
    out: dict[str, list[dict[str, float]]] = {}
    profiles = node_root / "cache" / "profiles"
    if profiles.is_dir():
        for d in profiles.iterdir():
            for f in d.glob("*.json"):
                try:
                    out.setdefault(d.name, []).append(dict(json.loads(f.read_text())))
                except (OSError, ValueError):
                    log.warning("skipping unreadable profile %s", f)
    for f in (node_root / "sandboxes").glob("*/lazy/profile.json"):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for layer in doc.get("layers", []):
            if layer.get("files"):
                out.setdefault(layer["content_digest"], []).append(dict(layer["files"]))
    return out


def prefetch_list(runs: list[dict[str, float]], index: LayerIndex) -> list[str]:
    """Files any run read, earliest first read first; only regular files of this layer."""
    first: dict[str, float] = {}
    for run in runs:
        for path, t in run.items():
            first[path] = min(t, first.get(path, t))
    regular = {e.path for e in index.entries if e.type == "reg"}
    return [p for p, _ in sorted(first.items(), key=lambda kv: (kv[1], kv[0])) if p in regular]


def optimize(store: Store, ref: str, node_root: Path, as_ref: str | None = None
             ) -> OptimizeResult:
    """Write new versions of an image's layers whose indexes carry prefetch lists from the
    recorded profiles, and a new image version stacking them."""
    img = resolve_image(store, ref)
    name, version = img.manifest.name, img.manifest.version
    if as_ref is not None:
        try:
            name, version = parse_ref(as_ref)
        except Exception as e:
            raise UsageError(f"invalid --as {as_ref!r}: expected NAME@VERSION ({e})") from e
    else:
        version = f"{version}-opt"
    profiles = collect_profiles(node_root)
    if not any(m.content_digest in profiles for _, m in img.layers):
        raise UsageError(f"no access profile is recorded for {ref} on this node",
                         hint=f"run it lazily first (dsec run --fetch lazy {ref} -- CMD), or "
                              f"give the workload: dsec optimize {ref} -- CMD")
    result = OptimizeResult(f"{name}@{version}", "")
    new_layers: list[str] = []
    new_manifests: list[Manifest] = []
    for digest, m in img.layers:
        runs = profiles.get(m.content_digest)
        if not runs or not m.index:
            new_layers.append(digest)
            new_manifests.append(m)
            result.layers.append({"layer": m.ref, "digest": digest, "prefetch": 0})
            continue
        old = load_index(store, m.index)
        files = prefetch_list(runs, old)
        index = LayerIndex(entries=old.entries, chunks=old.chunks, packs=old.packs,
                           params=old.params, prefetch=files, chunk_hash=old.chunk_hash)
        data = index.to_bytes()
        index_digest = sha256_hex(data)
        key = object_key("indexes", index_digest)
        if not store.has(key):
            store.put(key, data)
        lm = Manifest(**{**m.__dict__, "index": index_digest,
                         "version": version if img.manifest.kind == "layer" else f"{m.version}-opt",
                         "name": name if img.manifest.kind == "layer" else m.name,
                         "annotations": {**m.annotations, "dsec.prefetch.files": str(len(files)),
                                         "dsec.optimized.from": digest}})
        ld = put_manifest(store, lm)
        # a layer's optimized version is derived from its own: each run rewrites it
        commit_ref(store, lm.name, lm.version, ld, replace=True, verb="")
        new_layers.append(ld)
        new_manifests.append(lm)
        result.layers.append({"layer": lm.ref, "digest": ld, "prefetch": len(files)})
    if img.manifest.kind == "layer":
        result.image_digest = new_layers[0]
        return result
    from ...build.image import write_image

    result.image_digest, _ = write_image(
        store, name, version, new_layers, env=img.manifest.env, workdir=img.manifest.workdir,
        spec_digest=img.manifest.spec_digest, manifests=new_manifests, commit=True,
        replace=as_ref is None,  # the derived VERSION-opt is rewritten by each run
        created_by=f"dsec optimize {ref}")
    return result


def optimize_image(ref: str, cmd: list[str] | None = None, *, as_ref: str | None = None,
                   backend: str = "container", timeout: float | None = None,
                   store: str | None = None, state_dir: str | None = None) -> OptimizeResult:
    """The SDK entry of `dsec optimize`: profile ``cmd`` in a lazy sandbox when given (every
    file it reads, however long it runs), then `optimize` from all recorded profiles."""
    from ..node import CreateOptions, local_node

    node = local_node(state_dir, store)
    if cmd:
        rec = node.create(ref, CreateOptions(backend=backend, fetch="lazy",
                                             record_seconds=float("inf")))
        try:
            res = node.exec(rec.id, cmd, timeout=timeout)
            if res.exit_code != 0:
                log.warning("the profiled command exited with %d", res.exit_code)
        finally:
            node.remove(rec.id)
    with node.store() as st:
        return optimize(st, ref, node.root, as_ref)
