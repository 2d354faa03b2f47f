"""The store URL schemes dsec knows, and which class serves each: the one registry that
`dsec_cli.push.stores.open_store` opens stores through and `core.validate.store_url` checks
URLs against, so a scheme added with `register_scheme` is accepted wherever a store URL is.

Classes are named, not imported (module and class as strings, with the pip extra that
provides their dependency): checking a URL loads no store, and a missing dependency is
reported with its install hint only when its store is opened."""

from __future__ import annotations

import re

from .errors import UsageError

#: scheme -> (module, class, pip extra that provides its dependency)
SCHEMES: dict[str, tuple[str, str, str | None]] = {
    "file": ("dsec_cli.push.stores.file", "FileStore", None),
    "s3": ("dsec_cli.push.stores.s3", "S3Store", "s3"),
    "oci": ("dsec_cli.oci.store", "OCIStore", "oci"),
}

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]{0,31}\Z")  # RFC 3986, lower case


def register_scheme(scheme: str, module: str, cls: str, extra: str | None = None) -> None:
    """Serve ``<scheme>://`` URLs with class ``cls`` of ``module`` (a `Store` subclass,
    imported when such a store is first opened); ``extra`` names the pip extra to suggest
    when that import fails."""
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise UsageError(f"invalid store URL scheme {scheme!r}: lower-case letters, digits, "
                         "'+', '-' and '.', starting with a letter")
    SCHEMES[scheme] = (module, cls, extra)


def known() -> str:
    """The known schemes as a user reads them: ``file://, oci://, s3://``."""
    return ", ".join(f"{s}://" for s in sorted(SCHEMES))
