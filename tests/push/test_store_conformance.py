"""The store contract (tests/conformance/stores.py) against every registered scheme."""

from __future__ import annotations

from ..conformance.stores import *  # noqa: F403
