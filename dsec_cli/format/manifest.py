"""Manifests: the JSON description of one layer or one image, named by the sha256 of its
canonical bytes. A layer manifest names its index and packs; an image manifest names the
layer manifests it stacks, bottom to top."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..core.config import store_limits
from ..core.digests import check_digest, object_key, put_object, verify_sha256
from ..core.errors import FormatError, NotFoundError
from . import canonical
from .validate import check_size, fail, validate_manifest

MANIFEST_VERSION = 1
MEDIA_TYPE = "application/vnd.dsec.manifest.v1+json"


@dataclass
class Manifest:
    kind: Literal["layer", "image"]
    name: str
    version: str
    #: layer: sha256 of the canonical tree (paths, metadata, chunk ids), independent of packing
    content_digest: str = ""
    index: str | None = None  # layer: digest of its index object
    packs: list[str] = field(default_factory=list)  # layer: every pack its index references
    layers: list[str] = field(default_factory=list)  # image: layer manifest digests, bottom first
    base: list[str] = field(default_factory=list)  # layer: manifests its run steps ran over
    spec_digest: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    size: int = 0  # uncompressed bytes of regular files
    stored_size: int = 0  # compressed bytes of the chunks the index references
    files: int = 0
    created_by: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    format: int = MANIFEST_VERSION

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_bytes(self) -> bytes:
        doc = asdict(self)
        doc["mediaType"] = MEDIA_TYPE
        return canonical.dumps(doc)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "manifest") -> Manifest:
        """Decode and validate (format/validate.py): a CorruptObjectError names `what`."""
        check_size(what, data, store_limits().manifest_bytes, "manifest_bytes")
        doc: dict[str, Any] = canonical.loads(data, what)
        if not isinstance(doc, dict) or doc.get("mediaType") != MEDIA_TYPE:
            fail(what, "not a dsec manifest (mediaType)")
        if doc.get("format") != MANIFEST_VERSION:
            raise FormatError(f"{what} has format {doc.get('format')}, this dsec reads "
                              f"{MANIFEST_VERSION}; upgrade dsec")
        doc.pop("mediaType")
        try:
            m = cls(**doc)
        except TypeError as e:
            fail(what, f"unexpected or missing fields: {e}")
        return validate_manifest(m, what)


def load_manifest(store: Any, digest: str) -> Manifest:
    what = f"manifest {check_digest(digest)[:12]}"
    key = object_key("manifests", digest)
    try:
        data = store.get(key)
    except NotFoundError:
        raise NotFoundError(f"manifest {digest[:12]} is missing from {store.url}") from None
    return Manifest.from_bytes(verify_sha256(data, digest, what), what)


def put_manifest(store: Any, manifest: Manifest) -> str:
    return put_object(store, "manifests", manifest.to_bytes())
