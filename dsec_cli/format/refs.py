"""Refs: ``name@version`` -> manifest digest. Writing a ref is the only commit point."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..core.digests import check_digest, parse_ref, ref_key
from ..core.errors import FormatError, NotFoundError
from . import canonical


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
    doc = canonical.loads(data, f"ref {name}@{version}")
    try:
        return Ref(name, version, check_digest(doc["manifest"]), float(doc.get("updated", 0)))
    except (KeyError, TypeError) as e:
        raise FormatError(f"ref {name}@{version} is malformed") from e


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


def delete_ref(store: Any, ref: str) -> None:
    name, version = parse_ref(ref)
    get_ref(store, ref)  # a clear error for a ref that does not exist
    store.delete(ref_key(name, version))


def list_refs(store: Any) -> list[Ref]:
    out = []
    for info in store.list("refs/"):
        parts = info.key.split("/")
        if len(parts) != 3:
            continue
        try:
            data = store.get(info.key)
        except NotFoundError:
            continue  # removed between the listing and the read
        out.append(_decode(data, parts[1], parts[2]))
    return sorted(out, key=lambda r: (r.name, r.version))
