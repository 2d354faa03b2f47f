"""The retry layer every store is opened through: each primitive of the wrapped store runs
under `dsec_cli.push.retry.call`, so transient failures are retried the same way for every
scheme."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..retry import RetryPolicy, call
from .base import ObjectInfo, Store
from .registry import open_backend

T = TypeVar("T")


class RetryingStore(Store):
    """Wraps a store so that each primitive is retried under a `RetryPolicy`.

    The wrapped store is private: callers get the `Store` interface and nothing else, so no
    code path can reach around the retries (store-specific extras are not forwarded)."""

    policy: RetryPolicy
    _inner: Store

    def __init__(self, inner: Store, policy: RetryPolicy | None = None) -> None:
        if isinstance(inner, RetryingStore):  # one layer of retries, never retries of retries
            policy = policy or inner.policy
            inner = inner._inner
        super().__init__(inner.url)
        self._inner = inner
        self.policy = policy or RetryPolicy.from_env()
        self.preferred_read_size = inner.preferred_read_size  # type: ignore[misc]
        self.local = inner.local  # type: ignore[misc]

    @classmethod
    def from_url(cls, url: str, **options: object) -> RetryingStore:
        return open_retrying(url, **options)

    def _call(self, fn: Callable[[], T], what: str) -> T:
        return call(fn, f"{what} ({self.url})", self.policy)

    def _get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        return self._call(lambda: self._inner.get(key, start, length), f"reading {key}")

    def _put(self, key: str, data: bytes) -> None:
        self._call(lambda: self._inner.put(key, data), f"writing {key}")

    def put_file(self, key: str, path: Path) -> None:
        self._call(lambda: self._inner.put_file(key, path), f"writing {key}")

    def _stat(self, key: str) -> ObjectInfo | None:
        return self._call(lambda: self._inner.stat(key), f"checking {key}")

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # listings are materialised so that a retry restarts them from the beginning
        return iter(self._call(lambda: list(self._inner.list(prefix)), f"listing {prefix!r}"))

    def _delete(self, key: str) -> None:
        self._call(lambda: self._inner.delete(key), f"deleting {key}")

    def staging_dir(self) -> Path:
        return self._inner.staging_dir()

    def missing(self) -> str:
        return self._inner.missing()

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        with self._inner.write_batch():
            yield

    def close(self) -> None:
        self._inner.close()


def open_retrying(url: str | None = None, **options: object) -> RetryingStore:
    """Open a store with retries, including the connection check some stores make on open.
    `dsec_cli.push.stores.open_store` is this function."""
    policy = RetryPolicy.from_env()  # resolved once: it reads the config files
    store = call(lambda: open_backend(url, **options), f"opening {url or 'the default store'}",
                 policy)
    return RetryingStore(store, policy)
