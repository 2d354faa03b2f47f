"""Small file-system steps shared across layers."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path | str, missing_ok: bool = False) -> None:
    """Make a file's data durable (open it read-only and fsync); with ``missing_ok``, a file
    that is gone is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
