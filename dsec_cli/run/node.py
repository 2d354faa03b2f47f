"""A node's sandboxes (`Node`): the lifecycle core (lifecycle.py) with what composes it,
warm pools (pool.py), density (park, thaw, top: density.py), fork (fork.py), moves of parked
VMs (migrate.py), snapshots (snapshot.py) and reconcile and node gc (reconcile.py); and the
process-wide Node of a state dir (`local_node`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..core.config import load_config
from ..core.errors import ConfigError
from . import density, fork, images, reaper, reconcile, snapshot
from .images import Image
from .lifecycle import NodeCore, check_exec, require_root, sandbox_path
from .options import BACKEND_CHOICES, CreateOptions
from .pool import Pools
from .state import SandboxRecord

__all__ = ["BACKEND_CHOICES", "CreateOptions", "Image", "Node", "check_exec", "local_node",
           "require_root", "sandbox_path"]


class Node(NodeCore):
    """One node's sandboxes. Thread-safe; share one per process (see `local_node`)."""

    def __init__(self, state_dir: str | Path | None = None, store: str | None = None) -> None:
        super().__init__(state_dir, store)
        cfg = self.config
        try:
            self.pools = Pools(self, cfg.pool)
        except ConfigError as e:
            raise ConfigError(f"{cfg.sources.get('pool', 'config')}: {e.message}",
                              hint=e.hint) from None

    # -- create: a warm pool member, or one made now ------------------------------------------
    def create(self, image: str, opts: CreateOptions | None = None, *,
               from_pool: bool = True, sid: str | None = None) -> SandboxRecord:
        """A new sandbox: a warm pool member of the same (image, backend, limits, env) when
        the node keeps one (pool.py), else created now. ``from_pool=False`` always creates;
        ``sid`` is the id a sandbox created now gets (the node service's admission reserved
        it by that id)."""
        opts = opts or CreateOptions()
        opts.validate()
        require_root()
        pooled = from_pool and self._poolable(opts)
        rec = self.pools.take(image, opts) if pooled else None
        if rec is None:
            fetch = images.fetch_mode(opts.fetch, image, self.store(), self.cache_root)
            img = self.resolve_image(image) if pooled and fetch == "eager" else None
            rec = self.make(image, img, opts, fetch, sid=sid)
        return self._reaped(rec)

    def _reaped(self, rec: SandboxRecord) -> SandboxRecord:
        """A new sandbox with a TTL: the node removes it at expiry by itself (reaper.py)."""
        if rec.expires is not None:
            reaper.ensure(self)
        return rec

    def _poolable(self, opts: CreateOptions) -> bool:
        """Whether a create may take a warm pool member. Members are made eagerly and run as
        their image's user: a create asking for a lazy mount or for a user by name is made
        now. (``auto`` takes one: an image with a member is in the layer cache, which makes
        ``auto`` eager.)"""
        return opts.user is None and opts.fetch in ("auto", "eager") and self.pools.active()

    def take_pooled(self, image: str, opts: CreateOptions) -> SandboxRecord | None:
        """A warm pool member for this create, or None (no pool, or it is empty)."""
        opts.validate()
        rec = self.pools.take(image, opts) if self._poolable(opts) else None
        return None if rec is None else self._reaped(rec)

    # -- density, moves, snapshots, forks -----------------------------------------------------
    def park(self, sid: str) -> dict[str, Any]:
        """Stop a sandbox and push its memory out (to swap where there is swap); its
        resident, reclaimed and swapped bytes. See density.py."""
        return density.park(self, sid)

    def thaw(self, sid: str, prefetch: bool = False) -> dict[str, Any]:
        """Let a parked sandbox run again, with the same files and processes; ``prefetch``
        also reads its memory back from swap now, ahead of need (a running sandbox's too,
        after an idle reclaim). See density.py."""
        if prefetch:
            return density.prewarm(self, sid)
        return density.thaw(self, sid)

    def park_export(self, sid: str) -> dict[str, Any]:
        """Where a parked VM's files are, and its row (run/migrate.py)."""
        from . import migrate  # the VM backends' modules: loaded by the first move

        return migrate.export_parked(self, sid)

    def park_incoming(self, sid: str) -> str:
        """An empty directory for a moving sandbox's files (run/migrate.py)."""
        from . import migrate

        return migrate.incoming(self, sid)

    def park_import(self, exported: dict[str, Any]) -> SandboxRecord:
        """The moved files become this node's parked sandbox (run/migrate.py)."""
        from . import migrate

        return migrate.import_parked(self, exported)

    def top(self, interval: float = 0.0) -> list[dict[str, Any]]:
        """Per sandbox: CPU, resident, reclaimed and swapped memory, class, idle time."""
        return density.top(self, interval)

    def snapshot(self, sid: str, ref: str, push: str | None = None, *,
                 replace: bool = False) -> dict[str, Any]:
        """The sandbox's writable diff becomes layer ``NAME-layer@VERSION`` and image
        ``NAME@VERSION`` (the original's layers plus the new one); see snapshot.py."""
        return snapshot.snapshot(self, sid, ref, push, replace=replace)

    def fork(self, sid: str, n: int) -> dict[str, Any]:
        """``n`` new sandboxes starting from this one's files (see fork.py): ``copies``
        holds their records; the snapshot layer they share, where there is one."""
        return fork.fork(self, sid, n)

    # -- listing, reconcile, gc ----------------------------------------------------------------
    def sandboxes(self, reconcile: bool = True) -> list[SandboxRecord]:
        if reconcile:
            self.reconcile()
        return [r for r in self.db.all() if r.status != "pooled"]

    def reconcile(self) -> dict[str, list[str]]:
        """Make the database and the system agree after crashes (see reconcile.py)."""
        return reconcile.reconcile(self)

    def gc(self, budget: int | None = None, dry_run: bool = False) -> dict[str, Any]:
        """Remove expired and dead sandboxes, then evict unleased cached layers, least
        recently used first, until the cache fits the budget (see reconcile.py)."""
        return reconcile.gc(self, budget, dry_run)

    def close(self) -> None:
        """Stop this process's pool refill thread (waiting for a member being made)."""
        self.pools.stop()

    def describe(self, sid: str) -> dict[str, Any]:
        rec = self.lookup(sid)
        out = rec.public()
        if rec.status in ("running", "paused", "parked"):
            out.update(self.backend(rec.backend).describe(self.handle_of(rec)))
            out["usage"] = density.usage(self, rec)
        stats = self.fetch_stats(rec)
        if stats is not None:
            out["fetch"] = stats
        return out


_nodes: dict[str, Node] = {}
_nodes_lock = threading.Lock()


def local_node(state_dir: str | Path | None = None, store: str | None = None) -> Node:
    """The process-wide Node for a state dir (shared so agent connections stay warm); a
    long-lived process (the command server) gets a new one when the state dir was removed
    and made again."""
    key = str(Path(state_dir or load_config().state_dir).absolute()) + "|" + (store or "")
    with _nodes_lock:
        n = _nodes.get(key)
        if n is not None and not n.db.same_file():
            n.pools.stop(timeout=0)
            n = None
        if n is None:
            n = _nodes[key] = Node(state_dir, store)
        return n


def finish_pool_refills() -> None:
    """`Pools.finish` on every Node of this process."""
    with _nodes_lock:
        nodes = list(_nodes.values())
    for n in nodes:
        n.pools.finish()


def drop_connections() -> None:
    """Close every connection to a sandbox the Nodes of this process keep open (call it
    while nothing uses them: between the commands of a long-lived process)."""
    with _nodes_lock:
        nodes = list(_nodes.values())
    for n in nodes:
        with n._lock:
            backends = list(n._backends.values())
        for b in backends:
            b.drop_connections()
