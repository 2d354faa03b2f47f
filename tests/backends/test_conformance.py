"""The backend contract (tests/conformance/backends.py) against every registered backend."""

from __future__ import annotations

from ..conformance.backends import *  # noqa: F403
