"""Many small reads of one store: side by side from a store where each read is a round trip
(S3, a registry), in turn from a local one, where threads would only add their cost."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
Item = TypeVar("Item")

#: reads in flight at once from a remote store: enough to hide a round trip of tens of
#: milliseconds behind the others, few enough for a store's request limits
REMOTE_READS = 16


def read_all(store: Any, fn: Callable[[Item], T], items: Sequence[Item]) -> list[T | Exception]:
    """``fn(item)`` for every item, in the items' order; an exception raised for an item is
    returned in its place, for the caller to judge as it would have. From a store that is
    not local, up to `REMOTE_READS` run at once."""
    def one(item: Item) -> T | Exception:
        try:
            return fn(item)
        except Exception as e:  # noqa: BLE001 - handed back, judged by the caller
            return e

    if getattr(store, "local", True) or len(items) < 2:
        return [one(x) for x in items]
    with ThreadPoolExecutor(min(REMOTE_READS, len(items)),
                            thread_name_prefix="store-read") as pool:
        return list(pool.map(one, items))
