"""The store interface: a flat namespace of immutable objects plus mutable refs.

Backends implement a handful of primitive operations; everything smart (dedup,
parallelism, retries, verification) lives above them in `dsec_cli.push.transfer`.
Keys look like ``packs/ab/<sha256>``, ``indexes/..``, ``manifests/..``, ``refs/<name>/<version>``,
``pins/<id>`` and ``gc/<...>``; they are validated before any backend sees them.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ...core.config import load_config
from ...core.digests import validate_key


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch, as the store reports it


class Store(abc.ABC):
    """A place layers live. Objects are written whole and never modified in place,
    except refs, pins and gc state, whose `put` must be atomic (readers see the old or the
    new bytes, never a mix)."""

    scheme: ClassVar[str] = ""
    #: a good size for one ranged read from this store (coalescing neighbours up to it)
    preferred_read_size: ClassVar[int] = 4 << 20
    #: reads cost no round trip (a local or cluster filesystem): readers need not batch them
    local: ClassVar[bool] = False

    def __init__(self, url: str) -> None:
        self.url = url

    def missing(self) -> str:
        """Where nothing was ever written (a file store's root that does not exist), "" for
        a store that exists or cannot tell without a write (buckets, registries)."""
        return ""

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, **options: object) -> Store: ...

    # -- primitives every backend implements --------------------------------------------
    @abc.abstractmethod
    def _get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes of an object, or a range of it. Raises NotFoundError if missing."""

    @abc.abstractmethod
    def _put(self, key: str, data: bytes) -> None:
        """Write an object atomically."""

    @abc.abstractmethod
    def _stat(self, key: str) -> ObjectInfo | None: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects whose key starts with prefix (a folder such as ``refs/``)."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """Remove an object; removing a missing object is not an error."""

    # -- validated public surface (override the _put_file default for multipart etc.) ----
    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        return self._get(validate_key(key), start, length)

    def put(self, key: str, data: bytes) -> None:
        self._put(validate_key(key), data)

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file; backends override for streaming or multipart uploads."""
        self._put(validate_key(key), Path(path).read_bytes())

    def stat(self, key: str) -> ObjectInfo | None:
        return self._stat(validate_key(key))

    def has(self, key: str) -> bool:
        return self.stat(key) is not None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix:
            validate_key(prefix.rstrip("/"))
        return self._list(prefix)

    def delete(self, key: str) -> None:
        self._delete(validate_key(key))

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """Objects this thread puts inside become visible in the order they were put, each
        durable before the next is visible, as with one put at a time; a store may make them
        durable together and show them at the end. The default puts each as it comes."""
        yield

    def staging_dir(self) -> Path:
        """Where writers stage local files (packs) before `put_file`; a store on a local
        filesystem returns a directory on that filesystem, so uploads are renames."""
        path = Path(load_config().data_dir) / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has nothing to release."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
