"""Canonical JSON: the one byte encoding that digests are computed over."""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes, what: str) -> Any:
    """Decode a stored object's JSON; malformed bytes are a corrupt object (exit 2)."""
    from ..core.errors import CorruptObjectError

    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptObjectError(f"{what} is not valid JSON: {e}") from e
