"""Warm pools: sandboxes made ahead of demand, per (image digest, backend, limits, network, env,
workdir), so that a create takes one that is already running and the node makes the next one
in the background.

A pool member is an ordinary row of the node database with status ``pooled`` and the pool's
key in its spec; it was made by the same code path as any sandbox (its own id, upper dir,
cgroup, limits and environment), and nobody has seen its id. Taking one is a single write
transaction that turns the row into a running sandbox with the caller's image name and TTL,
so two processes never take the same member, and admission counts each member exactly once:
as ``pooled`` while it waits, as ``running`` after.

Which pools exist: the ``pools`` table (``dsec pool set``: a fixed size, or ``auto``) and,
with config ``pool: {auto: true}``, every key created recently. A learned size is the largest
burst of creations that fell in one ``window`` over the last ``idle``. All members together
stay under the ``memory`` budget (a member costs its memory limit, or a per-backend estimate
without one).

Refill runs in a thread of the process that owns the `Node` (the SDK process or the node
service; a short-lived CLI process that took members makes their replacements before it
exits). One refiller works at a time per node, under a lock file, so processes sharing a node
never overfill it. A refill killed midway leaves a ``creating`` row whose owner is dead:
reconcile tears it down like any interrupted create. Node gc removes members past their
pool's current size, members older than ``max_age``, and members that died.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..backends import _rootfs, backend_class
from ..core.errors import ConfigError, DsecError, UsageError
from ..core.units import parse_duration, parse_size
from . import images as _images
from .options import CreateOptions
from .state import SandboxRecord, now

if TYPE_CHECKING:
    from .lifecycle import NodeCore

log = logging.getLogger(__name__)


#: the create options that make a pool key (a TTL is set when a member is taken)
KEY_FIELDS = ("backend", "cpus", "memory", "pids", "disk", "network", "env", "workdir",
              "cpu_class", "egress")
RECENT_MAX = 1024


@dataclass(frozen=True)
class PoolSettings:
    """Config key ``pool`` (a mapping): ``auto`` (learn pools from creations, default off),
    ``max`` (members per pool), ``memory`` (budget of all members), ``window`` and ``idle``
    (learning: a burst is counted per window, over the last idle period), ``max_age``
    (members older than this are recycled by node gc), ``refill_interval`` (how often the
    refill thread looks even when nothing asked it to)."""

    auto: bool = False
    max: int = 8
    memory: int = 2 << 30
    window: float = 10.0
    idle: float = 600.0
    max_age: float = 3600.0
    refill_interval: float = 5.0

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> PoolSettings:
        out: dict[str, Any] = {}
        for key, value in (raw or {}).items():
            if key == "auto" and isinstance(value, bool):
                out[key] = value
            elif key == "max" and isinstance(value, int) and not isinstance(value, bool) \
                    and 0 <= value <= 10000:
                out[key] = value
            elif key == "memory" and isinstance(value, int | str) and not isinstance(value, bool):
                out[key] = parse_size(str(value), "pool.memory")
            elif key in ("window", "idle", "max_age", "refill_interval") \
                    and isinstance(value, int | float | str) and not isinstance(value, bool):
                secs = parse_duration(str(value), f"pool.{key}")
                if secs <= 0:
                    raise ConfigError(f"pool.{key} must be more than 0")
                out[key] = secs
            else:
                raise ConfigError(f"config key pool: invalid key or value {key!r}: {value!r}",
                                  hint="keys: auto (bool), max (int), memory (size), window, "
                                       "idle, max_age, refill_interval (durations)")
        return cls(**out)


def key_options(opts: CreateOptions) -> dict[str, Any]:
    return {f: getattr(opts, f) for f in KEY_FIELDS}


def pool_key(digest: str, opts: CreateOptions) -> str:
    doc = json.dumps({"digest": digest, "opts": key_options(opts)}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def member_cost(opts: CreateOptions) -> int:
    """A member's memory: its limit, or what an idle one of its backend holds."""
    return opts.memory or backend_class(opts.backend).member_estimate


def learned_size(recent: list[float], t: float, s: PoolSettings) -> int:
    """The largest number of creations in one window over the last idle period."""
    buckets: dict[int, int] = {}
    for c in recent:
        if t - c <= s.idle:
            b = int(c // s.window)
            buckets[b] = buckets.get(b, 0) + 1
    return min(s.max, max(buckets.values(), default=0))


@dataclass
class PoolRow:
    key: str
    image: str
    digest: str
    options: dict[str, Any]
    size: int | None
    recent: list[float]
    last: float

    def create_options(self) -> CreateOptions:
        return CreateOptions(**self.options)


#: called before a member is made with its options; returns the release of what it reserved
#: (the node service's admission), or raises to skip the member
Admit = Callable[[CreateOptions], Callable[[], None]]


class Pools:
    """The warm pools of one node, and this process's refill thread."""

    def __init__(self, node: NodeCore, raw: dict[str, Any] | None = None) -> None:
        self.node = node
        self.settings = PoolSettings.parse(raw)
        self.admit: Admit | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._last_pass = False  # process exit: one more pass, then stop
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._take_lock = threading.Lock()

    # -- database ----------------------------------------------------------------------------
    def _tx(self) -> Any:
        return self.node.db.tx()

    def rows(self) -> list[PoolRow]:
        return [PoolRow(r[0], r[1], r[2], json.loads(r[3]), r[4], json.loads(r[5]), r[6])
                for r in self.node.db.read().execute("SELECT * FROM pools ORDER BY key")]

    def active(self) -> bool:
        """Whether a create should look for a pool member (cheap: one small query)."""
        if self.settings.auto:
            return True
        return self.node.db.read().execute("SELECT 1 FROM pools LIMIT 1").fetchone() is not None

    def target(self, row: PoolRow, t: float | None = None) -> int:
        if row.size is not None:
            return row.size
        return learned_size(row.recent, t if t is not None else now(), self.settings)

    def members(self) -> dict[str, dict[str, list[SandboxRecord]]]:
        """Pool key -> {"pooled": [...], "creating": [...]} (creates of a dead process
        excluded: reconcile removes them)."""
        out: dict[str, dict[str, list[SandboxRecord]]] = {}
        for r in self.node.db.all():
            key = r.spec.get("pool")
            if not key or r.status not in ("pooled", "creating"):
                continue
            if r.status == "creating" and not _rootfs.alive(r.owner_pid, r.owner_start):
                continue
            out.setdefault(key, {"pooled": [], "creating": []})[r.status].append(r)
        return out

    # -- take ----------------------------------------------------------------------------------
    def take(self, image: str, opts: CreateOptions) -> SandboxRecord | None:
        """Claim a member for this create (or None) and note the demand. Costs one read of
        the image's ref and one write transaction: the member was made whole from this very
        manifest digest, so nothing is resolved or materialized again."""
        if _images.is_directory_image(image):
            return None
        digest = self.node.image_digest(image)
        key = pool_key(digest, opts)
        try:
            noted = False
            while True:
                rec = self._claim(key, image, digest, opts, note=not noted)
                noted = True
                if rec is None:
                    return None
                b = self.node.backend(rec.backend)
                if b.is_alive(self.node.handle_of(rec)):
                    return rec
                log.warning("pool member %s died while waiting; removing it", rec.id)
                self.node.remove(rec.id)
        finally:
            self.kick()

    def _claim(self, key: str, image: str, digest: str, opts: CreateOptions,
               note: bool) -> SandboxRecord | None:
        """One write transaction: note the creation (learned sizes) and turn the oldest
        member of the pool into a running sandbox. Threads of this process take turns on a
        lock first: sqlite's busy wait sleeps in steps of milliseconds, a lock wakes at once."""
        t = now()
        pid = os.getpid()
        with self._take_lock, self.node.db.tx() as db:
            if note:
                self._note(db, key, image, digest, opts, t)
            row = db.execute("SELECT id FROM sandboxes WHERE status='pooled' AND "
                             "json_extract(spec, '$.pool')=? ORDER BY created LIMIT 1",
                             (key,)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE sandboxes SET status='running', image=?, created=?, expires=?, "
                       "spec=json_remove(spec, '$.pool'), owner_pid=?, owner_start=? "
                       "WHERE id=?", (image, t, t + opts.ttl if opts.ttl else None, pid,
                                      _rootfs.proc_start_time(pid), row[0]))
        return self.node.db.get(row[0])

    def _note(self, db: Any, key: str, image: str, digest: str, opts: CreateOptions,
              t: float) -> None:
        row = db.execute("SELECT recent FROM pools WHERE key=?", (key,)).fetchone()
        if row is None:
            if self.settings.auto:
                db.execute("INSERT INTO pools VALUES (?,?,?,?,?,?,?)",
                           (key, image, digest, json.dumps(key_options(opts)), None,
                            json.dumps([t]), t))
            return
        recent = [c for c in json.loads(row[0]) if t - c <= self.settings.idle]
        recent = [*recent[-(RECENT_MAX - 1):], t]
        db.execute("UPDATE pools SET recent=?, last=? WHERE key=?", (json.dumps(recent), t, key))

    # -- set / drain / status ------------------------------------------------------------------
    def set(self, image: str, opts: CreateOptions, size: int | None,
            fill: bool = True) -> dict[str, Any]:
        """Keep ``size`` members of this (image, options) ready (None: learn the size);
        with ``fill``, make them before returning."""
        opts.validate()
        if size is not None and not 0 <= size <= 10000:
            raise UsageError(f"invalid pool size {size}: must be from 0 to 10000")
        if opts.ttl is not None or opts.fetch not in ("auto", "eager"):
            raise UsageError("a pool takes no --ttl (set it per create) and fetches eagerly")
        opts.fetch = "eager"  # members are made whole; creates that resolve to eager take them
        img = self.node.resolve_image(image)
        if not img.from_store:
            raise UsageError(f"image {image!r} is a directory: pools need a store image")
        key = pool_key(img.digest, opts)
        with self._tx() as db:
            db.execute("INSERT INTO pools VALUES (?,?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE "
                       "SET size=excluded.size, image=excluded.image",
                       (key, image, img.digest, json.dumps(key_options(opts)), size, "[]",
                        now()))
        if fill:
            self.refill(block=True)
        self.reclaim(only_key=key)
        return next(p for p in self.status() if p["key"] == key)

    def drain(self, key_prefix: str | None = None) -> list[str]:
        """Forget the pools (all, or those whose key starts with the prefix) and remove
        their members; the ids removed."""
        removed: list[str] = []
        with self._tx() as db:
            keys = [r[0] for r in db.execute("SELECT key FROM pools")]
            keys = [k for k in keys if not key_prefix or k.startswith(key_prefix)]
            if key_prefix and not keys:
                raise UsageError(f"no pool {key_prefix!r} on this node",
                                 hint="list them with `dsec pool ls`")
            db.executemany("DELETE FROM pools WHERE key=?", [(k,) for k in keys])
        with self._refill_lock(block=True):
            for key, m in self.members().items():
                if key_prefix and not key.startswith(key_prefix):
                    continue
                for r in m["pooled"]:
                    removed += self._remove_member(r)
        return removed

    def status(self) -> list[dict[str, Any]]:
        members = self.members()
        t = now()
        out = []
        for row in self.rows():
            m = members.get(row.key, {"pooled": [], "creating": []})
            opts = row.create_options()
            out.append({"key": row.key, "image": row.image, "digest": row.digest,
                        "backend": opts.backend,
                        "limits": {"cpus": opts.cpus, "memory": opts.memory, "pids": opts.pids,
                                   "disk": opts.disk},
                        "network": opts.network, "env": opts.env, "workdir": opts.workdir,
                        "size": "auto" if row.size is None else row.size,
                        "target": self.target(row, t), "ready": len(m["pooled"]),
                        "creating": len(m["creating"]), "member_memory": member_cost(opts),
                        # how many members the memory budget holds (of this pool alone)
                        "budget_members": self.settings.memory // member_cost(opts),
                        "last_create": row.last})
        return out

    def settings_dict(self) -> dict[str, Any]:
        return asdict(self.settings)

    # -- refill --------------------------------------------------------------------------------
    @contextmanager
    def _refill_lock(self, block: bool) -> Iterator[bool]:
        fd = os.open(self.node.root / "pool.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing drops the lock; so does the death of the process

    def refill(self, block: bool = False) -> int:
        """Make the members the pools lack, round robin over pools, within the memory budget;
        how many were made. Without ``block`` it returns 0 at once when another refiller is
        at work."""
        with self._refill_lock(block) as mine:
            if not mine:
                return 0
            # a caller waiting for the members (pool set, fill) gets them even after stop()
            return self._refill_locked(stoppable=not block)

    def _refill_locked(self, stoppable: bool) -> int:
        t = now()
        rows = [r for r in self.rows() if self.target(r, t) > 0]
        members = self.members()
        have = {r.key: sum(len(v) for v in members.get(r.key, {}).values()) for r in rows}
        used = sum(member_cost(row.create_options()) * have[row.key] for row in rows)
        for key, m in members.items():  # members of pools no longer listed still cost
            if key not in have:
                used += sum(member_cost(CreateOptions(backend=r.backend)) for v in m.values()
                            for r in v)
        made = 0
        blocked: set[str] = set()
        stopped = self._stopping.is_set if stoppable else (lambda: False)
        while not stopped():
            todo = [r for r in rows if r.key not in blocked and have[r.key] < self.target(r, t)]
            if not todo:
                break
            for row in todo:
                if stopped():
                    break
                opts = row.create_options()
                if used + member_cost(opts) > self.settings.memory:
                    blocked.add(row.key)
                    continue
                if not self._make_member(row, opts):
                    blocked.add(row.key)
                    continue
                have[row.key] += 1
                used += member_cost(opts)
                made += 1
        return made

    def _make_member(self, row: PoolRow, opts: CreateOptions) -> bool:
        release: Callable[[], None] | None = None
        try:
            if self.admit is not None:
                release = self.admit(opts)
            self.node.make(row.digest, None, opts, "eager", pool_key=row.key)
            return True
        except DsecError as e:
            log.warning("pool %s: could not make a member: %s", row.key, e)
            return False
        finally:
            if release is not None:
                release()

    def kick(self) -> None:
        """Wake this process's refill thread (starting it on first use)."""
        if self._stopping.is_set() or self._last_pass:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dsec-pool-refill",
                                                daemon=True)
                self._thread.start()
                atexit.register(self._at_exit)
        self._wake.set()

    def _loop(self) -> None:
        delay = self.settings.refill_interval
        while not self._stopping.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                self.refill()
                delay = self.settings.refill_interval
            except Exception:  # keep refilling later; a create never depends on it
                log.exception("pool refill failed")
                delay = min(60.0, delay * 2)
            if self._last_pass:
                break

    def _at_exit(self) -> None:
        """A process that took members replaces them before it exits (a short-lived CLI
        process would otherwise empty the pool); a member being made is finished."""
        self._last_pass = True
        self._wake.set()
        t = self._thread
        if t is not None:
            t.join(300.0)

    def finish(self) -> None:
        """Make the members this process's takes asked for, then end the refill thread until
        the next take: what a CLI process does at exit, for a process that serves short
        commands (the command server) after each."""
        with self._lock:
            t = self._thread
            if t is None or self._stopping.is_set():
                return
            self._last_pass = True
            self._wake.set()
        t.join(300.0)
        with self._lock:
            if self._thread is t and not t.is_alive():
                self._thread = None
                self._last_pass = False

    def stop(self, timeout: float = 300.0) -> None:
        """Stop the refill thread; a member being made is finished first (a kill instead
        leaves a row reconcile removes)."""
        self._stopping.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # -- reclaim (node gc) ---------------------------------------------------------------------
    def reclaim(self, dry_run: bool = False, only_key: str | None = None) -> list[str]:
        """Remove members past their pool's current size (oldest first), members older than
        ``max_age`` and members of pools no longer kept; the ids removed."""
        t = now()
        targets = {r.key: self.target(r, t) for r in self.rows()}
        out: list[str] = []
        with self._refill_lock(block=True):
            for key, m in self.members().items():
                if only_key is not None and key != only_key:
                    continue
                pooled = sorted(m["pooled"], key=lambda r: r.created)
                keep = max(0, targets.get(key, 0) - len(m["creating"]))
                excess = pooled[:max(0, len(pooled) - keep)]
                old = [r for r in pooled if t - r.created > self.settings.max_age]
                for r in {r.id: r for r in [*excess, *old]}.values():
                    out += [r.id] if dry_run else self._remove_member(r)
        if out and not dry_run and self._thread is not None:
            self.kick()
        return out

    def _remove_member(self, rec: SandboxRecord) -> list[str]:
        with self.node.db.tx() as db:  # claim it first: a concurrent take must not get it
            n = db.execute("UPDATE sandboxes SET status='dead' WHERE id=? AND status='pooled'",
                           (rec.id,)).rowcount
        if not n:
            return []
        try:
            self.node.remove(rec.id)
        except DsecError as e:
            log.warning("could not remove pool member %s: %s", rec.id, e)
            return []
        return [rec.id]


def parse_size_arg(size: str | int | None) -> int | None:
    """``auto`` -> None (learned), else a whole number of members."""
    if size is None or size == "auto":
        return None
    try:
        n = int(size)
    except (TypeError, ValueError):
        raise UsageError(f"invalid pool size {size!r}: a whole number or 'auto'") from None
    if not 0 <= n <= 10000 or (isinstance(size, float) and not math.isfinite(size)):
        raise UsageError(f"invalid pool size {size!r}: must be from 0 to 10000")
    return n
