"""Digests and object keys.

Objects in a store are named by the sha256 of their stored bytes and laid out as
``<kind>/<aa>/<rest>``; chunks are identified by the xxh3-128 of their uncompressed bytes.
Keys are validated on the way in so that no caller can address a path outside the store.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import xxhash

from .errors import IntegrityError, UsageError

KINDS = ("packs", "indexes", "manifests")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_REF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}\Z")
_KEY = re.compile(r"^[A-Za-z0-9._+@-]+(/[A-Za-z0-9._+@-]+)*\Z")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def chunk_id(data: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte xxh3-128 identity of a chunk's uncompressed bytes."""
    return xxhash.xxh3_128_digest(data)


def check_digest(digest: str) -> str:
    if not _HEX64.match(digest):
        raise UsageError(f"not a sha256 digest: {digest!r}")
    return digest


def object_key(kind: str, digest: str) -> str:
    """``packs/ab/abcdef...`` for a digest of the given kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown object kind {kind!r}")
    check_digest(digest)
    return f"{kind}/{digest[:2]}/{digest}"


def parse_object_key(key: str) -> tuple[str, str] | None:
    """Inverse of `object_key`; None for keys that are not content-addressed objects."""
    parts = key.split("/")
    if (len(parts) == 3 and parts[0] in KINDS and _HEX64.match(parts[2])
            and parts[1] == parts[2][:2]):
        return parts[0], parts[2]
    return None


def validate_key(key: str) -> str:
    """Reject keys that could escape a store's namespace (``..``, absolute, empty parts)."""
    if not _KEY.match(key) or any(p in (".", "..") for p in key.split("/")):
        raise UsageError(f"invalid store key {key!r}")
    return key


def put_object(store: Any, kind: str, data: bytes) -> str:
    """Store bytes under ``<kind>/<aa>/<sha256>`` unless already there; return the digest."""
    digest = sha256_hex(data)
    key = object_key(kind, digest)
    if not store.has(key):
        store.put(key, data)
    return digest


def verify_sha256(data: bytes, digest: str, what: str) -> bytes:
    actual = sha256_hex(data)
    if actual != digest:
        raise IntegrityError(f"{what} is corrupt: sha256 is {actual}, expected {digest}")
    return data


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``name@version``; both parts are restricted to a safe alphabet."""
    name, sep, version = ref.partition("@")
    if not sep or not _REF_PART.match(name) or not _REF_PART.match(version):
        raise UsageError(
            f"invalid reference {ref!r}: expected NAME@VERSION "
            "(letters, digits, '.', '_', '+', '-')"
        )
    return name, version


def ref_key(name: str, version: str) -> str:
    parse_ref(f"{name}@{version}")
    return f"refs/{name}/{version}"
