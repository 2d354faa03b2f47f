"""Store implementations, selected by URL scheme through a lazy registry (`core.schemes`:
`register_scheme` adds one, accepted wherever a store URL is).

`open_store` is the only way in, and what it returns always retries transient errors
(`dsec_cli.push.retry.RetryingStore`): the lazy mount daemon, builds, image resolution and
transfers all read through the same retries. The bare backend is opened only by the retry
layer, through `open_backend`."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from urllib.parse import urlparse

from ...core import schemes
from ...core.errors import NotFoundError, UsageError
from ...core.schemes import register_scheme
from .base import ObjectInfo, Store

__all__ = ["ObjectInfo", "Store", "open_store", "default_store_url", "register_scheme"]

def default_store_url() -> str:
    """The configured store URL, checked like one given on the command line; a bad one is a
    `ConfigError` naming where it was set (``DSEC_STORE``, a config file)."""
    from ...core import validate
    from ...core.config import load_config
    from ...core.errors import ConfigError

    cfg = load_config()
    where = cfg.sources.get("store", "")
    what = (where[1:] if where.startswith("$") else f"store in {where}" if where
            else f"store URL of the data directory {cfg.data_dir!r}")
    try:
        return validate.store_url(cfg.store, what)
    except UsageError as e:
        raise ConfigError(e.message) from None


def open_store(url: str | None = None, **options: object) -> Store:
    """Open the store a URL names (a bare path is a ``file://`` store; None is the
    configured default), retrying transient errors of every request, the connection check
    some stores make on open included. A malformed URL is a `UsageError` naming it."""
    from ..retry import open_retrying

    return open_retrying(url, **options)


def check_exists(store: Store) -> None:
    """For commands that only read a store (ls, inspect, export, verify, gc, the source of a
    push or pull, rmi): a store path where nothing was ever written is a `NotFoundError`
    naming it (a typo'd path), not an empty store, and is not created. The built-in default
    store, before anything was built into it, reads as empty."""
    where = store.missing()
    if not where:
        return
    from ...core.config import load_config

    if not load_config().sources.get("store") and store.url == default_store_url():
        return
    raise NotFoundError(f"no store at {where} ({store.url}): nothing was ever written there",
                        hint="check the path; reading commands never create a store "
                             "(`dsec build`, `push`, `pull` and `import` make one)")


def open_backend(url: str | None = None, **options: object) -> Store:
    """The bare store a URL names, without retries: for `dsec_cli.push.retry` only."""
    from ...core import validate
    from ...core.config import store_limits

    store_limits()  # a malformed limit stops every command here, before an object is read
    url = default_store_url() if url is None else validate.store_url(url)
    if options.get("endpoint_url") is not None:
        validate.endpoint_url(str(options["endpoint_url"]))
    if "://" not in url:
        url = Path(os.path.expanduser(url)).resolve().as_uri()
    scheme = urlparse(url).scheme
    if scheme not in schemes.SCHEMES:
        raise UsageError(f"unknown store URL scheme in {url!r}; known: {schemes.known()}")
    module, cls, extra = schemes.SCHEMES[scheme]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        hint = f"pip install 'dsec[{extra}]'" if extra else None
        raise UsageError(f"the {scheme}:// store needs {e.name}, which is not installed",
                         hint=hint) from e
    store: Store = getattr(mod, cls).from_url(url, **options)
    return store
