"""The requests in flight on one multiplexed connection, by id: what the reader of a
connection routes each reply to. The thread and the asyncio clients of the agent protocol
(backends/sandbox_agent) and of the node protocol (run/cluster) all keep their callers here,
each with its own kind of queue (`queue.Queue` or `asyncio.Queue`)."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

Q = TypeVar("Q")

#: ids are 31-bit and never 0 (both protocols carry them as a u32 or a JSON number)
_ID_MASK = 0x7FFFFFFF


class InFlight(Generic[Q]):
    """Callers waiting for replies, by request id. Safe to use from several threads; once
    `close` has run, no request is added (what was waiting is handed back to be told)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, Q] = {}
        self._next = 1
        self.closed: str | None = None  # why the connection ended

    def add(self, waiter: Q) -> int | None:
        """A new request's id, its replies to go to ``waiter``; None once closed."""
        with self._lock:
            if self.closed is not None:
                return None
            rid = self._next
            self._next = (self._next + 1) & _ID_MASK or 1
            self._waiting[rid] = waiter
            return rid

    def start_at(self, rid: int) -> None:
        """Number the next requests from ``rid`` on (a peer that may still answer an earlier
        connection's ids must not see them again)."""
        with self._lock:
            self._next = rid & _ID_MASK or 1

    def get(self, rid: int) -> Q | None:
        """Who waits for request ``rid`` (None: nobody, any more)."""
        with self._lock:
            return self._waiting.get(rid)

    def done(self, rid: int) -> None:
        with self._lock:
            self._waiting.pop(rid, None)

    def waiting(self) -> list[Q]:
        with self._lock:
            return list(self._waiting.values())

    def close(self, reason: str) -> list[Q]:
        """The connection ended: no request is added from now on; who still waits."""
        with self._lock:
            self.closed = reason
            return list(self._waiting.values())
