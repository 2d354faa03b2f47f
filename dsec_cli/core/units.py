"""Sizes and durations as users write them (``512M``, ``30s``) and their bounds: a leaf
that the configuration (config.py) and the checks of typed values (validate.py) both read."""

from __future__ import annotations

import math

from .errors import ConfigError

#: the largest size: more than any memory or disk; runtimes take int64 bytes (1 EiB)
MAX_SIZE = 1 << 60
#: the longest duration or wait, in seconds: 100 years
MAX_SECONDS = 100 * 365 * 86400.0

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(text: str, what: str = "size") -> int:
    """'512M', '2G', '1024' -> bytes."""
    return int(size_value(text, what))


def size_value(text: str, what: str) -> float:
    """A size as a float (a fraction of a unit allowed), finite, not negative, at most
    `MAX_SIZE`."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _SIZE_UNITS else (t, "")
    try:
        value = float(num) * _SIZE_UNITS[unit]
    except ValueError:
        raise ConfigError(f"invalid {what} {text!r}: expected a number with K, M, G or T") from None
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ConfigError(f"invalid {what} {text!r}: must be a finite size of at most 1E")
    if value < 0:
        raise ConfigError(f"invalid {what} {text!r}: must not be negative")
    return value


def parse_duration(text: str, what: str = "duration") -> float:
    """'30s', '15m', '2h', '7d' -> seconds."""
    t = str(text).strip().lower()
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _DURATION_UNITS else (t, "s")
    try:
        value = float(num) * _DURATION_UNITS[unit]
    except ValueError:
        raise ConfigError(f"invalid {what} {text!r}: expected e.g. 30s, 15m, 2h, 7d") from None
    if not math.isfinite(value) or value > MAX_SECONDS:
        raise ConfigError(f"invalid {what} {text!r}: must be a finite duration of at most "
                          "100 years")
    if value < 0:
        raise ConfigError(f"invalid {what} {text!r}: must not be negative")
    return value
