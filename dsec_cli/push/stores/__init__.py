"""Store implementations, selected by URL scheme through a lazy registry (`core.schemes`:
`register_scheme` adds one, accepted wherever a store URL is).

`open_store` is the only way in, and what it returns always retries transient errors
(`retrying.RetryingStore`): the lazy mount daemon, builds, image resolution and transfers
all read through the same retries. The bare backend is opened only by the retry
layer, through `registry.open_backend`."""

from __future__ import annotations

from ...core.config import load_config
from ...core.errors import NotFoundError
from ...core.schemes import register_scheme
from .base import ObjectInfo, Store
from .registry import default_store_url
from .retrying import open_retrying

__all__ = ["ObjectInfo", "Store", "open_store", "default_store_url", "register_scheme"]


def open_store(url: str | None = None, **options: object) -> Store:
    """Open the store a URL names (a bare path is a ``file://`` store; None is the
    configured default), retrying transient errors of every request, the connection check
    some stores make on open included. A malformed URL is a `UsageError` naming it."""
    return open_retrying(url, **options)


def check_exists(store: Store) -> None:
    """For commands that only read a store (ls, inspect, export, verify, gc, the source of a
    push or pull, rmi): a store path where nothing was ever written is a `NotFoundError`
    naming it (a typo'd path), not an empty store, and is not created. The built-in default
    store, before anything was built into it, reads as empty."""
    where = store.missing()
    if not where:
        return
    if not load_config().sources.get("store") and store.url == default_store_url():
        return
    raise NotFoundError(f"no store at {where} ({store.url}): nothing was ever written there",
                        hint="check the path; reading commands never create a store "
                             "(`dsec build`, `push`, `pull` and `import` make one)")
