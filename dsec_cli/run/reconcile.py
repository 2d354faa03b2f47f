"""Crash recovery and node gc: `reconcile` makes the node database and the system agree
(finishing half-done creates, marking dead sandboxes, removing mounts, dirs, cgroups and runc
state nobody owns); `gc` applies job leases (run/jobs/), removes expired and dead sandboxes
and evicts cached layers past the budget, least recently used first."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import SandboxHandle, _cgroups, _rootfs
from ..core.config import load_config
from ..core.errors import NotFoundError
from ..core.files import remove_tree
from ..core.units import parse_duration, parse_size
from .density import reclaim_idle, recover_parked
from .images import unmount_lazy
from .pins import unpin
from .state import now

if TYPE_CHECKING:
    from .node import Node


TEMPLATE_IDLE = 7 * 86400.0


def reconcile(node: Node) -> dict[str, list[str]]:
    """Make the database and the system agree after crashes: finish half-done creates,
    mark dead sandboxes, remove mounts, dirs, cgroups and runc state nobody owns."""
    report: dict[str, list[str]] = {"aborted": [], "dead": [], "orphans": [], "pool_dead": []}
    # list the system first, then read rows: a row is written before its resources exist
    dirs = {p.name for p in node.sandboxes_dir.iterdir()} if node.sandboxes_dir.is_dir() \
        else set()
    groups = _cgroups.children(node.cgroup_parent)
    runc = {p.name for p in node.runc_root.iterdir()} if node.runc_root.is_dir() else set()
    rows = {r.id: r for r in node.db.all()}
    for r in rows.values():
        if r.status == "creating":
            if not _rootfs.alive(r.owner_pid, r.owner_start):
                node.teardown(SandboxHandle(r.id, r.backend, dict(r.handle or {})),
                               node.sandboxes_dir / r.id)
                if r.spec.get("from_store"):
                    unpin(node.store, node.cgroup_parent, r.id)
                node.db.delete(r.id)
                report["aborted"].append(r.id)
        elif r.status in ("running", "paused", "parked"):
            if recover_parked(node, r):
                report.setdefault("park_recovered", []).append(r.id)
            if not node.backend(r.backend).is_alive(node.handle_of(r)):
                node.db.update(r.id, status="dead")
                report["dead"].append(r.id)
        elif r.status == "pooled":  # nobody's yet: a dead member just goes
            if not node.backend(r.backend).is_alive(node.handle_of(r)):
                try:
                    node.remove(r.id)
                except NotFoundError:
                    continue  # taken or removed concurrently
                report["pool_dead"].append(r.id)
    for sid in (dirs | groups | runc) - set(rows):
        if sid.startswith("."):
            continue
        _cgroups.Cgroup(f"{node.cgroup_parent}/{sid}").remove()
        shutil.rmtree(node.runc_root / sid, ignore_errors=True)
        unmount_lazy(node.sandboxes_dir / sid, node.cache_root)
        _rootfs.remove_tree(node.sandboxes_dir / sid)
        report["orphans"].append(sid)
    return report


def gc(node: Node, budget: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Remove expired and dead sandboxes, then evict unleased cached layers, least
    recently used first, until the cache fits the budget."""
    report: dict[str, Any] = {"removed": [], "evicted": [], "freed_bytes": 0}
    if not dry_run:
        report.update(node.reconcile())
    from ..build.steps import clean_stale_staging

    # staging dirs (and overlay mounts) of builds killed during a `run` step
    report["stale_builds"] = clean_stale_staging(Path(load_config().data_dir) / "tmp",
                                                 dry_run=dry_run)
    if (node.root / "jobs.db").exists():  # job leases: park, reclaim (run/jobs/)
        from .jobs import node_jobs

        report["jobs"] = node_jobs(node).sweep(dry_run)
    # warm pool members past their pool's size or age (pool.py)
    report["pool_reclaimed"] = node.pools.reclaim(dry_run=dry_run)
    # saved VM boots no restore used for a week (backends/vm/vmsnap.py)
    from ..backends.vm.vmsnap import prune

    report["vm_boots_pruned"] = prune(node.root / "vm", TEMPLATE_IDLE, dry_run)
    if not dry_run:  # files of moves to this node that never finished (migrate.py)
        from .migrate import clean_incoming

        report["incoming_removed"] = clean_incoming(node)
    t = now()
    for r in node.db.all():
        expired = r.expires is not None and r.expires <= t
        if expired or r.status == "dead":
            report["removed"].append({"id": r.id, "reason": "expired" if expired else "dead"})
            if not dry_run:
                try:
                    node.remove(r.id)
                except NotFoundError:
                    pass  # removed concurrently
    idle = load_config().idle_reclaim
    if idle:  # the idle-reclaim policy (density.py): memory back from idle sandboxes
        report["reclaimed"] = reclaim_idle(node, parse_duration(idle, "idle_reclaim"), dry_run)
    budget = budget if budget is not None else parse_size(node.cache_budget, "cache budget")
    from ..push.materialize import LayerCache

    cache = LayerCache(node.cache_root)
    entries = sorted(cache.entries(), key=lambda e: e[1])  # oldest use first
    total = sum(size for _, _, size in entries)
    leased = node.db.leased_layers()
    for path, _, size in entries:
        if total <= budget:
            break
        if str(path) in leased:
            continue
        report["evicted"].append(path.name)
        report["freed_bytes"] += size
        total -= size
        if not dry_run:
            tmp = path.with_name(f".tmp-evict-{path.name[:16]}-{secrets.token_hex(4)}")
            try:
                os.rename(path, tmp)  # atomic: a concurrent create re-materializes it
            except OSError:
                continue
            remove_tree(tmp)
    report["cache_bytes"] = total
    if not dry_run and not node.db.all():
        _cgroups.Cgroup(node.cgroup_parent).remove_if_empty()
    return report
