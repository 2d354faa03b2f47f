"""Jobs on a node: leases, rollouts, admission slots and the trajectory journal.

A job owns sandboxes through a lease that its trainer renews. Each sandbox of a job is a
*rollout*: a trajectory whose every exec is a journaled *step* (argv, cwd, env, stdin and its
digest, result, the writable state's digest before and after, duration), written to
``jobs.db`` beside the node database (sqlite WAL, ``synchronous=FULL``: a committed step
survives a crash of the trainer or the node). A step is written as ``running`` before the
command starts and completed after, so a step interrupted by a dead trainer is known:

- an exec carrying an idempotency key whose step is done returns the journaled result and
  runs nothing;
- one whose step was interrupted runs again only where the sandbox's state digest still
  equals the digest before that step (the command changed nothing); otherwise the rollout is
  rebuilt first (`replay`), so the step never runs twice on one state.

`replay` makes a fresh sandbox from the image plus the rollout's last snapshot (a layer
taken every K steps or T seconds with the node's snapshot machinery, so it dedups against the
image), re-executes the committed steps after that snapshot, checking each recorded state
digest, and leaves the journal's results as they were.

`sweep` (called by node gc) applies the lease: past ``park_grace`` after the lease expired
the job's sandboxes are parked; past ``reclaim_grace`` they are removed and the rollouts marked
lost; past ``retain`` more the job's rows and snapshot refs go too. Admission slots cap the
rollouts a job holds at once; requests past the cap queue in ticket order.

The parts, each building on the ones before it: `store` (the database, settings, names),
`rows` (rows every part shares), `admission` (slots), `rollouts` (a job's sandboxes, grades,
snapshot refs), `lease` (start, renew, park, thaw, remove, sweep), `replay` (snapshots and
rebuilding a rollout) and `journal` (steps); `NodeJobs` is all of them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .journal import Journal
from .store import JobSettings, Step, StepRunning, check_key, check_name

if TYPE_CHECKING:
    from ..node import Node

__all__ = ["JobSettings", "NodeJobs", "Step", "StepRunning", "check_key", "check_name",
           "node_jobs"]


class NodeJobs(Journal):
    """The jobs of one node. Every method takes and returns plain values (the node service
    serves them to cluster clients as they are)."""


_jobs: dict[str, NodeJobs] = {}
_jobs_lock = threading.Lock()


def node_jobs(node: Node) -> NodeJobs:
    """The process-wide jobs of a node."""
    with _jobs_lock:
        j = _jobs.get(str(node.root))
        if j is None or j.node is not node:
            j = _jobs[str(node.root)] = NodeJobs(node)
        return j
