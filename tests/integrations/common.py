"""Helpers the framework adapters' tests share."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import TypeVar

import dsec_cli as dsec
from tests.run.conftest import dsec as dsec_command

T = TypeVar("T")


def sandbox_ids(env: dict[str, str]) -> list[str]:
    """The ids `dsec ps` lists on the node of ``env``."""
    return [s["id"] for s in json.loads(dsec_command(env, "ps", "--json").stdout)]


def run(coro: Awaitable[T]) -> T:
    """Run ``coro`` in a loop of its own, closing the loop's node sessions after it."""
    async def main() -> T:
        try:
            return await coro
        finally:
            await dsec.close_sessions()

    return asyncio.run(main())
