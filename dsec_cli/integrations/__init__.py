"""Adapters that run dsec sandboxes inside agent and RL frameworks, one module each, each behind
its optional extra."""

from __future__ import annotations

from ..api.aio import AsyncSandbox
from ..api.aio_jobs import AsyncRollout


async def rollout_sandbox(rollout: AsyncRollout) -> AsyncSandbox:
    """The `AsyncSandbox` of a job's rollout, wherever the job placed it (a cluster node's
    as ``NODE/ID``)."""
    sid = str(rollout.sandbox_id)
    if rollout.node and "/" not in sid:
        sid = f"{rollout.node}/{sid}"
    return await AsyncSandbox.attach(sid)
