"""Retries of transient store failures, written once for every store: the policy and the
loop (`call`); `dsec_cli.push.stores.retrying.RetryingStore` applies them to every store.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..core.config import env, net_timeouts
from ..core.errors import StoreTimeoutError, StoreUnavailableError, TransientStoreError

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
