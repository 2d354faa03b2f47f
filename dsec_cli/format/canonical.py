"""Canonical JSON: the one byte encoding that digests are computed over."""

from __future__ import annotations

import json
from typing import Any

from ..core.errors import CorruptObjectError


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes, what: str) -> Any:
    """Decode a stored object's JSON; malformed bytes are a corrupt object (exit 2)."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptObjectError(f"{what} is not valid JSON: {e}") from e


def dumps_with(obj: dict[str, Any], raw: dict[str, bytes]) -> bytes:
    """``dumps`` of ``obj`` with the values of ``raw``'s keys given already encoded (each
    the `dumps` of that value): the same bytes as ``dumps({**obj, **decoded raw})``, without
    encoding a large value again."""
    keys = sorted({*obj, *raw})
    return b"{" + b",".join(
        dumps(k) + b":" + (raw[k] if k in raw else dumps(obj[k])) for k in keys) + b"}"
