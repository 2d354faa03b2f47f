"""Canonical JSON: the one byte encoding that digests are computed over."""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes, what: str) -> Any:
    from ..core.errors import FormatError

    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{what} is not valid JSON: {e}") from e
