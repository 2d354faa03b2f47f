"""Validation of what users type: references, sandbox ids, node names, store URLs, sizes,
durations and numbers.

Every check raises `UsageError` (exit 2) with a message that names the option or argument
and shows the bad value (cut short when it is long), before anything is read or written.
The CLI commands and the SDK entry points they call share these functions, so a value is
judged the same way whichever way it came in.
"""

from __future__ import annotations

import math
import re
from urllib.parse import urlparse

from . import schemes
from .errors import UsageError
from .units import MAX_SECONDS, parse_duration, parse_size

#: longest free-text value (a path, a URL, a command) accepted anywhere
MAX_TEXT = 4096
MAX_REF = 257  # NAME@VERSION, 128 characters each
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
_LOCAL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
#: the largest count accepted (what kernels and runtimes take as a 32-bit number)
MAX_COUNT = (1 << 31) - 1
#: the largest process limit: the kernel's own bound on pids (PID_MAX_LIMIT)
MAX_PIDS = 1 << 22
#: the largest CPU share: more CPUs than any machine has
MAX_CPUS = 1 << 16


def shown(value: object, limit: int = 60) -> str:
    """``repr`` of a value, cut short when it is long, for error messages."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:limit]}...{size}"


def text(value: object, what: str, *, max_len: int = MAX_TEXT, allow_newline: bool = False
         ) -> str:
    """A non-empty string of valid UTF-8 without NUL or other control characters (tab and,
    where allowed, newline excepted), at most ``max_len`` characters."""
    if not isinstance(value, str):
        raise UsageError(f"invalid {what} {shown(value)}: expected a string")
    if not value:
        raise UsageError(f"invalid {what}: it is empty")
    if len(value) > max_len:
        raise UsageError(f"invalid {what} {shown(value)}: longer than {max_len} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"invalid {what} {shown(value)}: not valid UTF-8") from None
    allowed = "\t\n" if allow_newline else "\t"
    bad = next((c for c in value if (ord(c) < 32 or ord(c) == 127) and c not in allowed), None)
    if bad is not None:
        raise UsageError(f"invalid {what} {shown(value)}: contains the control character "
                         f"{bad!r}")
    return value


def ref(value: object, what: str = "reference") -> str:
    """``NAME@VERSION`` (each part letters, digits, '.', '_', '+', '-'; 128 at most)."""
    from .digests import parse_ref

    s = text(value, what, max_len=MAX_REF)
    try:
        parse_ref(s)
    except UsageError:
        raise UsageError(f"invalid {what} {shown(s)}: expected NAME@VERSION (letters, digits, "
                         "'.', '_', '+', '-'; at most 128 each)") from None
    return s


def image(value: object, what: str = "IMAGE") -> str:
    """What `dsec run` accepts as an image: NAME@VERSION, a manifest digest or a directory
    path; here only its form is checked (not empty, no control characters)."""
    return text(value, what)


def node_name(value: object, what: str = "node name") -> str:
    s = text(value, what, max_len=63)
    if not _NODE.match(s):
        raise UsageError(f"invalid {what} {shown(s)}: letters, digits, '-', '_', '.' "
                         "(at most 63, starting with a letter or digit)")
    return s


def node_option(value: str | None, what: str = "--node") -> str | None:
    """``--node``: a node name, ``auto`` or ``local``; None when not given."""
    return None if value is None else node_name(value, what)


def sandbox_id(value: object, what: str = "sandbox id") -> str:
    """``[NODE/]ID``: the id (or a unique prefix of it) is letters, digits, '-' and '_'."""
    s = text(value, what, max_len=64 + 1 + 63)
    node, sep, local = s.rpartition("/")
    if sep:
        node_name(node, f"node in {what} {shown(s)}")
    if not _LOCAL_ID.match(local):
        raise UsageError(f"invalid {what} {shown(s)}: expected [NODE/]ID, the id being "
                         "letters, digits, '-' and '_' (64 at most)")
    return s


def store_url(value: object, what: str = "store URL") -> str:
    """A store URL of a registered scheme (`core.schemes`: ``file://``, ``s3://``,
    ``oci://`` and any added) or a bare directory path. Only the form is checked here; each
    store checks its own parts (bucket, repository) on open."""
    s = text(value, what)
    if "://" not in s:
        return s  # a path: a file:// store
    scheme = s.split("://", 1)[0]
    if scheme not in schemes.SCHEMES:
        raise UsageError(f"invalid {what} {shown(s)}: unknown store URL scheme {scheme!r}; "
                         f"known: {schemes.known()}")
    if scheme != "file":
        try:
            port = urlparse(s).port
        except ValueError:
            raise UsageError(f"invalid {what} {shown(s)}: the port must be a number from 1 "
                             "to 65535") from None
        if port == 0:
            raise UsageError(f"invalid {what} {shown(s)}: the port must be from 1 to 65535")
    return s


def endpoint_url(value: str | None, what: str = "--endpoint-url") -> str | None:
    if value is None:
        return None
    s = text(value, what)
    parsed = urlparse(s)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UsageError(f"invalid {what} {shown(s)}: expected http(s)://HOST[:PORT]")
    try:
        parsed.port  # noqa: B018 -- raises on a port out of range
    except ValueError:
        raise UsageError(f"invalid {what} {shown(s)}: the port must be from 1 to 65535"
                         ) from None
    return s


def size(value: object, what: str = "size") -> int:
    """``512M``, ``2G``, ``1024`` -> bytes: finite, not negative, at most 1 EiB."""
    return parse_size(text(value, what, max_len=64), what)


def duration(value: object, what: str = "duration") -> float:
    """``30s``, ``15m``, ``2h``, ``7d`` -> seconds: finite, not negative."""
    return parse_duration(text(value, what, max_len=64), what)


def positive_int(value: int | None, what: str, minimum: int = 1, maximum: int = MAX_COUNT
                 ) -> int | None:
    """A count (processes, jobs, copies, pages): a whole number from ``minimum`` to
    ``maximum``."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int)
            or not minimum <= value <= maximum):
        raise UsageError(f"invalid {what} {shown(value)}: must be a whole number from "
                         f"{minimum} to {maximum}")
    return value


def positive_float(value: float | None, what: str, maximum: float = MAX_SECONDS
                   ) -> float | None:
    """A finite number above zero and at most ``maximum`` (timeouts and intervals in
    seconds by default; CPU shares pass `MAX_CPUS`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"invalid {what} {shown(value)}: expected a number")
    if not (math.isfinite(value) and 0 < value <= maximum):
        raise UsageError(f"invalid {what} {shown(value)}: must be a finite number above 0 "
                         f"and at most {maximum:.12g}")
    return float(value)
