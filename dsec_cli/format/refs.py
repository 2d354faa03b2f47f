"""Refs: ``name@version`` -> manifest digest. Writing a ref is the only commit point."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..core.config import store_limits
from ..core.digests import check_digest, parse_ref, ref_key
from ..core.errors import DsecError, NotFoundError, RefConflictError
from ..core.reads import read_all
from . import canonical
from .validate import check_size, validate_ref_doc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ref:
    name: str
    version: str
    manifest: str
    updated: float

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


def _decode(data: bytes, name: str, version: str) -> Ref:
    what = f"ref {name}@{version}"
    check_size(what, data, store_limits().ref_bytes, "ref_bytes")
    manifest, updated = validate_ref_doc(canonical.loads(data, what), what)
    return Ref(name, version, manifest, updated)


def get_ref(store: Any, ref: str) -> Ref:
    name, version = parse_ref(ref)
    try:
        data = store.get(ref_key(name, version))
    except NotFoundError:
        raise NotFoundError(f"no layer or image {ref} in {store.url}",
                            hint="`dsec ls` lists what the store holds") from None
    return _decode(data, name, version)


def resolve(store: Any, ref: str) -> str:
    """A ``name@version`` or a bare manifest digest (``sha256:...`` or 64 hex) -> digest."""
    bare = ref.removeprefix("sha256:")
    if len(bare) == 64 and all(c in "0123456789abcdef" for c in bare):
        return bare
    return get_ref(store, ref).manifest


def set_ref(store: Any, name: str, version: str, manifest_digest: str) -> Ref:
    check_digest(manifest_digest)
    r = Ref(name, version, manifest_digest, time.time())
    store.put(ref_key(name, version), canonical.dumps({"manifest": r.manifest,
                                                        "updated": r.updated}))
    return r


def current_ref(store: Any, ref: str) -> str:
    """The manifest digest ``name@version`` names in the store, or "" where there is none."""
    try:
        return get_ref(store, ref).manifest
    except NotFoundError:
        return ""


def check_ref(store: Any, ref: str, digest: str, *, replace: bool, verb: str) -> str:
    """The one rule for every writer of a ref (build, snapshot, import, push, pull):
    versions are immutable. Returns the digest ``ref`` names now ("" for none); raises
    `RefConflictError` where that is other content than ``digest`` and not ``replace``. A
    writer that cannot know its digest before its work (a snapshot) passes "" to be refused
    any existing ref."""
    current = current_ref(store, ref)
    if current and current != digest and not replace:
        raise RefConflictError(ref, store.url, current, digest, verb=verb)
    return current


def commit_ref(store: Any, name: str, version: str, digest: str, *, replace: bool,
               verb: str) -> str:
    """Point ``name@version`` at ``digest`` under `check_ref`'s rule: the manifest it
    already names is a no-op. Returns the digest the ref named before when ``replace``
    moved it, else ""."""
    current = check_ref(store, f"{name}@{version}", digest, replace=replace, verb=verb)
    if current == digest:
        return ""
    set_ref(store, name, version, digest)
    return current


def delete_ref(store: Any, ref: str) -> None:
    name, version = parse_ref(ref)
    get_ref(store, ref)  # a clear error for a ref that does not exist
    store.delete(ref_key(name, version))


def list_refs(store: Any, errors: list[DsecError] | None = None) -> list[Ref]:
    """Every ref of a store. A ref that cannot be read is skipped with a warning naming it
    (and appended to `errors` when given), so one bad ref does not hide the others. From a
    remote store the refs are read side by side (`core.reads`)."""
    items = []
    for info in store.list("refs/"):
        parts = info.key.split("/")
        if len(parts) == 3:
            items.append((info.key, parts[1], parts[2]))

    def read(item: tuple[str, str, str]) -> Ref:
        key, name, version = item
        parse_ref(f"{name}@{version}")
        return _decode(store.get(key), name, version)

    out = []
    for (key, _, _), got in zip(items, read_all(store, read, items), strict=True):
        if isinstance(got, NotFoundError):
            continue  # removed between the listing and the read
        if isinstance(got, DsecError):
            log.warning("skipping %s: %s", key, got.message)
            if errors is not None:
                errors.append(got)
            continue
        if isinstance(got, Exception):
            raise got
        out.append(got)
    return sorted(out, key=lambda r: (r.name, r.version))
