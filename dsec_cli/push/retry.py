"""Retries of transient store failures, written once for every store.

Only `TransientStoreError` (connection refused or reset, timeouts, 429, 5xx) is retried, a
bounded number of times with exponential backoff and jitter; every other error (a missing
object, a missing bucket, an authentication failure, corruption) is raised at once. A store
that keeps failing transiently becomes a `StoreUnavailableError`.

Timeouts get one more bound: an endpoint that never answers costs each attempt a whole
timeout, so a timed-out operation is retried only while the time spent so far plus one more
timeout stays within ``connect_timeout + read_timeout`` (30 s by default). A dead endpoint
thus fails one operation within that bound, and the message says how long it waited.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..core.errors import StoreTimeoutError, StoreUnavailableError, TransientStoreError
from .stores.base import ObjectInfo, Store

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # total tries, the first included
    base_delay: float = 0.2  # seconds before the second try; doubles each time
    max_delay: float = 5.0
    timeout_budget: float = 30.0  # seconds of timed-out attempts one operation may spend

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """`DSEC_STORE_RETRIES` overrides the number of attempts (>= 1); the timeout budget
        is the configured connect + read timeout."""
        from ..core.config import env, net_timeouts

        budget = net_timeouts().total
        raw = env("DSEC_STORE_RETRIES")
        if raw and raw.isdigit() and int(raw) >= 1:
            return cls(attempts=int(raw), timeout_budget=budget)
        return cls(timeout_budget=budget)

    def delay(self, attempt: int) -> float:
        """Full jitter (AWS architecture blog): spreads clients that failed together."""
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))


def call(fn: Callable[[], T], what: str, policy: RetryPolicy | None = None) -> T:
    """Run ``fn``; retry it while it raises `TransientStoreError`."""
    policy = policy or RetryPolicy.from_env()
    start = time.monotonic()
    for attempt in range(policy.attempts):
        try:
            return fn()
        except TransientStoreError as e:
            spent = time.monotonic() - start
            if isinstance(e, StoreTimeoutError) and spent + e.waited > policy.timeout_budget:
                raise StoreUnavailableError(
                    f"{e.message} (gave up after {spent:.0f}s and {attempt + 1} attempt(s))",
                    hint=e.hint or "check that the store's server is up and answering; "
                                   "DSEC_CONNECT_TIMEOUT and DSEC_READ_TIMEOUT set the waits",
                ) from e
            if attempt + 1 >= policy.attempts:
                raise StoreUnavailableError(
                    f"{e.message} (still failing after {policy.attempts} attempts)",
                    hint=e.hint or "check that the store's server is up and reachable",
                ) from e
            pause = policy.delay(attempt)
            log.info("%s: %s; retrying in %.2fs", what, e.message, pause)
            time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


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
    from .stores import open_backend

    policy = RetryPolicy.from_env()  # resolved once: it reads the config files
    store = call(lambda: open_backend(url, **options), f"opening {url or 'the default store'}",
                 policy)
    return RetryingStore(store, policy)
