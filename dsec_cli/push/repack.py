"""Repacking: live chunks of mostly dead packs are copied into new packs, and the layers
that used them get new indexes, manifests and refs, so the old packs become garbage.

A layer's identity is its content digest, which depends on its tree and chunk ids only, so
a repacked layer is the same layer: node caches (keyed by content digest) stay valid. Its
manifest digest changes, and so do those of the images stacking it; their refs are moved
from the old manifest to the new one only if they still point at the old one. Pinned old
manifests keep their old packs alive until the pins go, as any other pinned object.

Runs as a writer (under a writer lease), in commit order: new packs, then indexes, then
manifests, then refs. A repack killed midway leaves only unreferenced new objects.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.digests import object_key, verify_sha256
from ..core.errors import DsecError, NotFoundError
from ..format.index import ChunkLoc, LayerIndex, put_index
from ..format.manifest import Manifest, load_manifest, put_manifest
from ..format.pack import PackWriter
from ..format.refs import get_ref, list_refs, set_ref
from .dedup import load_index
from .lease import WriterLease
from .stores.base import Store

log = logging.getLogger(__name__)
PACK_TARGET = 32 << 20


@dataclass
class RepackReport:
    packs_rewritten: list[str] = field(default_factory=list)
    packs_written: list[str] = field(default_factory=list)
    bytes_copied: int = 0
    manifests_rewritten: dict[str, str] = field(default_factory=dict)  # old -> new
    refs_moved: list[str] = field(default_factory=list)
    refs_skipped: list[str] = field(default_factory=list)  # moved by someone else meanwhile


def repack(store: Store, packs: set[str]) -> RepackReport:
    """Rewrite every layer reachable from a ref that uses one of ``packs``."""
    report = RepackReport()
    if not packs:
        return report
    with WriterLease(store, "repack"):
        refs = list_refs(store)
        manifests: dict[str, Manifest] = {}
        for r in refs:
            _load_tree(store, r.manifest, manifests)
        layers = {d: m for d, m in manifests.items()
                  if m.kind == "layer" and m.index and set(m.packs) & packs}
        if not layers:
            return report
        indexes = {d: load_index(store, m.index) for d, m in layers.items() if m.index}
        moved = _copy_live_chunks(store, packs, indexes.values(), report)
        new_digest: dict[str, str] = {}
        for d, m in layers.items():
            index = _relocate(indexes[d], moved)
            idx_digest = put_index(store, index)
            used = sorted({index.packs[c.pack] for c in index.chunks})
            new_digest[d] = put_manifest(store, replace(m, index=idx_digest, packs=used))
        for d, m in manifests.items():
            if m.kind == "image" and any(x in new_digest for x in m.layers):
                new_digest[d] = put_manifest(store, replace(
                    m, layers=[new_digest.get(x, x) for x in m.layers]))
        report.manifests_rewritten = new_digest
        report.packs_rewritten = sorted(packs)
        for r in refs:
            if r.manifest not in new_digest:
                continue
            try:
                current = get_ref(store, r.ref).manifest
            except NotFoundError:
                current = None
            if current != r.manifest:  # rewritten or removed by another client meanwhile
                report.refs_skipped.append(r.ref)
                continue
            set_ref(store, r.name, r.version, new_digest[r.manifest])
            report.refs_moved.append(r.ref)
    return report


def _load_tree(store: Store, digest: str, out: dict[str, Manifest]) -> None:
    if digest in out:
        return
    m = out[digest] = load_manifest(store, digest)
    for layer in m.layers:
        _load_tree(store, layer, out)


def _copy_live_chunks(store: Store, packs: set[str], indexes: Iterable[LayerIndex],
                      report: RepackReport) -> dict[tuple[str, int], tuple[str, int]]:
    """(old pack, old offset) -> (new pack, new offset) for every chunk still in use."""
    live: dict[str, dict[int, ChunkLoc]] = {}
    for index in indexes:
        for c in index.chunks:
            pack = index.packs[c.pack]
            if pack in packs:
                live.setdefault(pack, {})[c.offset] = c
    moved: dict[tuple[str, int], tuple[str, int]] = {}
    staging = Path(tempfile.mkdtemp(prefix="repack-", dir=store.staging_dir()))
    writer: PackWriter | None = None
    pending: list[tuple[str, int, int]] = []  # (old pack, old offset, new offset)

    def seal() -> None:
        nonlocal writer
        if writer is None:
            return
        fp = writer.finish()
        writer = None
        try:
            store.put_file(object_key("packs", fp.digest), fp.path)
        finally:
            fp.path.unlink(missing_ok=True)
        report.packs_written.append(fp.digest)
        for old, off, new_off in pending:
            moved[(old, off)] = (fp.digest, new_off)
        pending.clear()

    try:
        for pack in sorted(live):
            data = verify_sha256(store.get(object_key("packs", pack)), pack, f"pack {pack[:12]}")
            for start, end, cs in _ranges(live[pack]):
                if writer is None:
                    writer = PackWriter(staging)
                # one copy of a range the chunks share (a chunk group's frame), each chunk
                # keeping its place relative to the others
                pcs = writer.add_blob([memoryview(data)[start:end]], [
                    (c.chunk_id, c.codec, c.offset - start, c.clen, c.ulen) for c in cs])
                pending += [(pack, c.offset, pc.offset) for c, pc in zip(cs, pcs, strict=True)]
                report.bytes_copied += end - start
                if writer.size >= PACK_TARGET:
                    seal()
        seal()
    except DsecError:
        if writer is not None:
            writer.abort()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return moved


def _ranges(chunks: dict[int, ChunkLoc]) -> list[tuple[int, int, list[ChunkLoc]]]:
    """The live chunks of one pack as (start, end, chunks) byte ranges to copy: chunks whose
    ranges overlap (the members of one chunk group, format/codec.py) share one range."""
    out: list[tuple[int, int, list[ChunkLoc]]] = []
    for off, c in sorted(chunks.items()):
        if out and off < out[-1][1]:
            start, end, cs = out[-1]
            out[-1] = (start, max(end, off + c.clen), [*cs, c])
        else:
            out.append((off, off + c.clen, [c]))
    return out


def _relocate(index: LayerIndex, moved: dict[tuple[str, int], tuple[str, int]]) -> LayerIndex:
    packs: list[str] = []
    pack_no: dict[str, int] = {}

    def number(p: str) -> int:
        if p not in pack_no:
            pack_no[p] = len(packs)
            packs.append(p)
        return pack_no[p]

    chunks = []
    for c in index.chunks:
        old = index.packs[c.pack]
        new_pack, new_off = moved.get((old, c.offset), (old, c.offset))
        chunks.append(replace(c, pack=number(new_pack), offset=new_off))
    return LayerIndex(entries=index.entries, chunks=chunks, packs=packs, params=index.params,
                      prefetch=index.prefetch, chunk_hash=index.chunk_hash)
