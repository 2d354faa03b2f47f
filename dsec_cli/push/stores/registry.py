"""Opening the bare store a URL names: its scheme looked up in `core.schemes` (the class
that serves it, imported now, with the pip extra to install when its dependency is
missing). `dsec_cli.push.stores.open_store` wraps what `open_backend` opens in the retry
layer."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from urllib.parse import urlparse

from ...core import schemes, validate
from ...core.config import load_config, store_limits
from ...core.errors import ConfigError, UsageError
from .base import Store


def default_store_url() -> str:
    """The configured store URL, checked like one given on the command line; a bad one is a
    `ConfigError` naming where it was set (``DSEC_STORE``, a config file)."""
    cfg = load_config()
    where = cfg.sources.get("store", "")
    what = (where[1:] if where.startswith("$") else f"store in {where}" if where
            else f"store URL of the data directory {cfg.data_dir!r}")
    try:
        return validate.store_url(cfg.store, what)
    except UsageError as e:
        raise ConfigError(e.message) from None


def open_backend(url: str | None = None, **options: object) -> Store:
    """The bare store a URL names, without retries: for the retry layer only."""
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
