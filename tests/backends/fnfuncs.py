"""Functions the fncall pool tests run inside the sandbox (importable by reference)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

_STATE: Any = None


def add(a: Any, b: Any) -> Any:
    return a + b


def listdir(path: str) -> list[str]:
    return sorted(os.listdir(path))


def connect(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=2):
        pass


def boom() -> None:
    raise ValueError("boom")


def hog(n: int) -> int:
    return len(bytearray(n))


def sleep(s: float) -> None:
    time.sleep(s)


def set_global(v: Any) -> None:
    global _STATE
    _STATE = v


def get_global() -> Any:
    return _STATE


class Thing:
    pass


def returns_object() -> Thing:
    return Thing()
