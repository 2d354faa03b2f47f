"""Checking a store's objects: what `dsec verify` calls.

From the given refs (default: every ref) it reads each ref, manifest and index, validates
them field by field (format/validate.py), checks that each layer manifest's content digest
is the one its index gives and that every pack it needs is present. ``deep`` also reads
every pack whole, checks its sha256 and its trailer, and decompresses and re-hashes every
chunk the indexes reference (xxh3-128, and sha256 where the index carries one).

Each bad object is one `Problem`; the walk goes on past it, so one run names them all.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.digests import chunk_id, object_key, parse_ref, sha256_hex
from ..core.errors import DsecError, NotFoundError
from ..format.codec import CODEC_ZGROUP, decode, decode_group
from ..format.index import ChunkLoc, LayerIndex
from ..format.manifest import Manifest, load_manifest
from ..format.pack import read_toc
from ..format.refs import get_ref
from ..format.validate import check_layer, is_digest
from .dedup import load_index
from .stores import check_exists
from .stores.base import Store
from .stores.retrying import open_retrying

log = logging.getLogger(__name__)


@dataclass
class Problem:
    kind: str  # ref, manifest, index, pack or chunk
    name: str  # name@version, or the object's digest (a chunk: its xxh3-128 id)
    message: str
    via: str = ""  # the ref it was reached from

    def __str__(self) -> str:
        short = self.name if "@" in self.name else self.name[:12]
        via = f" (via {self.via})" if self.via and self.via != self.name else ""
        return f"{self.kind} {short}{via}: {self.message}"


@dataclass
class VerifyReport:
    store: str
    deep: bool
    refs: int = 0
    manifests: int = 0
    indexes: int = 0
    packs: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class _Walk:
    store: Store
    report: VerifyReport
    manifests: dict[str, Manifest | None] = field(default_factory=dict)
    indexes: dict[str, LayerIndex | None] = field(default_factory=dict)
    #: pack digest -> (index digest, chunk number) of every chunk read from it
    packs: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def problem(self, kind: str, name: str, e: DsecError | str, via: str) -> None:
        msg = e if isinstance(e, str) else e.message
        self.report.problems.append(Problem(kind, name, msg, via))

    def manifest(self, digest: str, via: str) -> None:
        if digest in self.manifests:
            return
        try:
            m: Manifest | None = load_manifest(self.store, digest)
        except DsecError as e:
            m = None
            self.problem("manifest", digest, e, via)
        self.manifests[digest] = m
        if m is None:
            return
        for child in m.layers:
            self.manifest(child, via)
        if m.kind == "layer" and m.index:
            self.layer(digest, m, via)

    def layer(self, digest: str, m: Manifest, via: str) -> None:
        assert m.index is not None
        if m.index not in self.indexes:
            try:
                self.indexes[m.index] = load_index(self.store, m.index)
            except DsecError as e:
                self.indexes[m.index] = None
                self.problem("index", m.index, e, via)
        index = self.indexes[m.index]
        needed = set(m.packs)
        if index is not None:
            try:
                check_layer(m, digest, index)
            except DsecError as e:
                self.problem("manifest", digest, e, via)
            for n, c in enumerate(index.chunks):
                pack = index.packs[c.pack]
                needed.add(pack)
                self.packs.setdefault(pack, []).append((m.index, n))
        for pack in sorted(needed):
            self.packs.setdefault(pack, [])


def verify(store: Store, refs: Sequence[str] = (), *, deep: bool = False) -> VerifyReport:
    """Check the objects reachable from `refs` (default: all refs) in an open store."""
    report = VerifyReport(store.url, deep)
    walk = _Walk(store, report)
    for ref, digest in _roots(store, refs, walk):
        report.refs += 1
        walk.manifest(digest, ref)
    report.manifests = len(walk.manifests)
    report.indexes = len(walk.indexes)
    report.packs = len(walk.packs)
    for pack, users in sorted(walk.packs.items()):
        if deep:
            _deep_pack(walk, pack, users)
        elif not store.has(object_key("packs", pack)):
            walk.problem("pack", pack, "missing from the store", _via(walk, users))
    return report


def _roots(store: Store, refs: Sequence[str], walk: _Walk) -> list[tuple[str, str]]:
    """(ref, manifest digest) to start from; refs that cannot be read are problems."""
    out = []
    if refs:
        for ref in refs:
            bare = ref.removeprefix("sha256:")
            if is_digest(bare):
                out.append((ref, bare))
                continue
            try:
                out.append((ref, get_ref(store, ref).manifest))
            except NotFoundError:
                raise
            except DsecError as e:
                walk.problem("ref", ref, e, ref)
        return out
    for info in store.list("refs/"):
        parts = info.key.split("/")
        if len(parts) != 3:
            continue
        ref = f"{parts[1]}@{parts[2]}"
        try:
            parse_ref(ref)
            out.append((ref, get_ref(store, ref).manifest))
        except NotFoundError:
            continue  # removed while listing
        except DsecError as e:
            walk.problem("ref", info.key, e, "")
    return out


def _via(walk: _Walk, users: list[tuple[str, int]]) -> str:
    return f"index {users[0][0][:12]}" if users else ""


def _deep_pack(walk: _Walk, pack: str, users: list[tuple[str, int]]) -> None:
    """Read a pack whole: its sha256, its trailer, and every chunk an index reads from it."""
    try:
        data = walk.store.get(object_key("packs", pack))
    except NotFoundError:
        walk.problem("pack", pack, "missing from the store", _via(walk, users))
        return
    except DsecError as e:
        walk.problem("pack", pack, e, _via(walk, users))
        return
    walk.report.bytes_read += len(data)
    actual = sha256_hex(data)
    if actual != pack:
        walk.problem("pack", pack, f"corrupt: sha256 is {actual}", _via(walk, users))
    try:
        read_toc(data, f"pack {pack[:12]}")
    except DsecError as e:
        walk.problem("pack", pack, e, _via(walk, users))
    done: set[tuple[int, int, bytes]] = set()
    todo: list[tuple[str, ChunkLoc]] = []
    for index_digest, n in users:
        index = walk.indexes[index_digest]
        assert index is not None
        c = index.chunks[n]
        key = (c.offset, c.clen, c.chunk_id)
        if key in done:
            continue
        done.add(key)
        walk.report.chunks += 1
        if c.offset + c.clen > len(data):
            walk.problem("chunk", c.chunk_id.hex(), f"in pack {pack[:12]} at {c.offset}+"
                         f"{c.clen}: past the end of the pack", f"index {index_digest[:12]}")
            continue
        todo.append((index_digest, c))
    # the members of one chunk group are decoded together: one decompression per group
    groups: dict[int, list[tuple[str, ChunkLoc]]] = {}
    for index_digest, c in todo:
        if c.codec == CODEC_ZGROUP:
            groups.setdefault(c.offset + c.clen, []).append((index_digest, c))
        else:
            _check_chunk(walk, pack, index_digest, c, _decoded(data, c))
    for end, members in groups.items():
        first = min(c.offset for _, c in members)
        try:
            datas: list[bytes | DsecError] = list(decode_group(
                memoryview(data)[first:end], [c.ulen for _, c in members],
                [c.offset - first for _, c in members]))
        except DsecError:  # decoded one by one, to name the broken members
            datas = [_decoded(data, c) for _, c in members]
        for (index_digest, c), raw in zip(members, datas, strict=True):
            _check_chunk(walk, pack, index_digest, c, raw)


def _decoded(data: bytes, c: ChunkLoc) -> bytes | DsecError:
    try:
        return decode(c.codec, memoryview(data)[c.offset:c.offset + c.clen], c.ulen)
    except DsecError as e:
        return e


def _check_chunk(walk: _Walk, pack: str, index_digest: str, c: ChunkLoc,
                 raw: bytes | DsecError) -> None:
    what = f"in pack {pack[:12]} at {c.offset}+{c.clen}"
    if isinstance(raw, DsecError):
        walk.problem("chunk", c.chunk_id.hex(), f"{what}: {raw.message}",
                     f"index {index_digest[:12]}")
        return
    if len(raw) != c.ulen or chunk_id(raw) != c.chunk_id:
        walk.problem("chunk", c.chunk_id.hex(), f"{what}: xxh3-128 mismatch (corrupt)",
                     f"index {index_digest[:12]}")
    elif c.sha256 is not None and hashlib.sha256(raw).digest() != c.sha256:
        walk.problem("chunk", c.chunk_id.hex(), f"{what}: sha256 mismatch (corrupt)",
                     f"index {index_digest[:12]}")


def verify_store(refs: Sequence[str] = (), *, store: str | None = None, deep: bool = False,
                 endpoint_url: str | None = None, insecure: bool = False) -> VerifyReport:
    """Check a store by URL (default: the configured one); what `dsec verify` calls."""
    from .api import store_options

    with open_retrying(store, **store_options(endpoint_url, insecure)) as s:
        check_exists(s)
        return verify(s, refs, deep=deep)
