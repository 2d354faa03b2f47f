"""Store garbage collection: mark from refs and pins, sweep the rest in two phases.

Safe while other clients build and push (docs/stores.md, "gc protocol"):

1. mark: every object reachable from a ref (``refs/``) or a pin (``pins/``, held by running
   sandboxes) is live; a ref whose closure cannot be walked stops all deletion;
2. phase 1: unreachable objects older than the grace period become *candidates*, recorded
   with the time in ``gc/pending``; younger ones are left alone (a writer without a lease may
   be about to reference them);
3. phase 2: candidates recorded at least `grace` ago and still unreachable are deleted, under
   the `dsec_cli.push.lease` handshake: put ``gc/deleting``, read the writer leases, give up
   if one is live, mark again, delete, drop the marker.

A candidate that becomes reachable again (a push reused it) is simply dropped from the
pending list. `grace` 0 marks and deletes in one run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.digests import check_digest, object_key, parse_object_key
from ..core.errors import DsecError, NotFoundError
from ..format.closure import closure
from ..format.refs import get_ref
from .lease import GcMarker, _ttl, read_leases
from .stores.base import ObjectInfo, Store
from .stores.retrying import RetryingStore

log = logging.getLogger(__name__)
PENDING = "gc/pending"
PINS = "pins/"
OBJECT_PREFIXES = ("packs/", "indexes/", "manifests/")
#: S3 reports LastModified in whole seconds, so an object may look up to 1 s older than it is
MTIME_SLACK = 1.0


@dataclass
class GcReport:
    store: str
    dry_run: bool
    grace: float
    refs: int = 0
    pins: int = 0
    reachable: int = 0
    reachable_bytes: int = 0
    unreachable: int = 0
    recent: int = 0  # unreachable but younger than the grace period: kept
    marked: list[str] = field(default_factory=list)  # became candidates in this run
    waiting: int = 0  # candidates whose grace has not passed yet
    resurrected: int = 0  # candidates that became reachable again
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    would_delete: list[str] = field(default_factory=list)  # --dry-run
    deferred: str = ""  # why phase 2 did not run
    dangling: list[str] = field(default_factory=list)  # refs or pins that cannot be walked
    #: live indexes that cannot be read: they might reference any pack, so none is deleted
    unreadable: list[str] = field(default_factory=list)
    leases_live: int = 0
    leases_removed: int = 0
    temp_files_removed: int = 0  # file:// stores: leftovers of killed writers
    #: live packs whose dead fraction passes the threshold: what repack rewrites
    repack_candidates: list[dict[str, Any]] = field(default_factory=list)
    dead_bytes_in_live_packs: int = 0
    #: what repacking did (packs rewritten and written, bytes copied, refs moved)
    repacked: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- mark ---------------------------------------------------------------------------------
def _pin_manifests(store: Store, report: GcReport) -> list[tuple[str, str]]:
    """(what, manifest digest) for every pin. A pin is JSON with ``manifest`` or
    ``manifests``; anything else is reported as dangling (and blocks deletion)."""
    out = []
    for info in store.list(PINS):
        try:
            doc = json.loads(store.get(info.key))
            digests = doc.get("manifests") or [doc["manifest"]]
            out += [(info.key, check_digest(str(d))) for d in digests]
        except NotFoundError:
            continue  # released while listing
        except (ValueError, KeyError, TypeError, AttributeError, DsecError):
            report.dangling.append(f"{info.key} (malformed pin)")
    report.pins = len({w for w, _ in out})
    return out


def _refs(store: Store, report: GcReport) -> list[tuple[str, str]]:
    """(name@version, manifest) of every ref; a ref removed while listing is skipped
    (`format.refs.list_refs` would fail on it, and gc runs beside `dsec rmi`); a ref that
    cannot be read is reported as dangling, which stops all deletion."""
    out = []
    for info in store.list("refs/"):
        parts = info.key.split("/")
        if len(parts) != 3:
            continue
        ref = f"{parts[1]}@{parts[2]}"
        try:
            out.append((ref, get_ref(store, ref).manifest))
        except NotFoundError:
            continue
        except DsecError as e:  # a ref that cannot be read might reach anything
            report.dangling.append(f"{info.key}: {e.message}")
    return out


def mark(store: Store, report: GcReport) -> set[str]:
    roots = _refs(store, report)
    report.refs = len(roots)
    roots += _pin_manifests(store, report)
    live: set[str] = set()
    for what, digest in roots:
        try:
            live.update(closure(store, digest))
        except DsecError as e:
            report.dangling.append(f"{what}: {e.message}")
    return live


def _pack_usage(store: Store, live: set[str], objects: dict[str, ObjectInfo], report: GcReport,
                threshold: float) -> None:
    """How much of each live pack reachable indexes still use. A pack is a concatenation
    of independently decodable chunk ranges (those of a chunk group's members overlap), so
    its dead fraction is 1 - (bytes the referenced ranges cover / pack size); packs past
    `threshold` are reported as repack candidates.

    Fail-safe: every pack a readable live index uses becomes live too (a manifest whose
    ``packs`` omits one cannot get it deleted), and a live index that cannot be read is
    reported in ``unreadable``, which keeps every pack this run."""
    from .dedup import load_index

    used: dict[str, set[tuple[int, int]]] = {}
    for key in sorted(live):
        kind, digest = parse_object_key(key) or ("", "")
        if kind != "indexes":
            continue
        try:
            index = load_index(store, digest)
        except NotFoundError:
            continue  # the closure walk names missing objects through `verify`
        except DsecError as e:
            report.unreadable.append(f"{key}: {e.message}")
            continue
        for c in index.chunks:
            used.setdefault(index.packs[c.pack], set()).add((c.offset, c.clen))
    live.update(object_key("packs", p) for p in used)
    if report.unreadable:
        return  # usage is unknown for what the unreadable indexes use: no repack advice
    for key, info in objects.items():
        kind, digest = parse_object_key(key) or ("", "")
        if kind != "packs" or key not in live or not info.size:
            continue
        live_bytes = _covered(used.get(digest, set()))
        dead = max(0, info.size - live_bytes)
        report.dead_bytes_in_live_packs += dead
        if dead / info.size > threshold:
            report.repack_candidates.append({"pack": digest, "size": info.size,
                                             "live_bytes": live_bytes,
                                             "dead_fraction": round(dead / info.size, 3)})


def _covered(ranges: set[tuple[int, int]]) -> int:
    """Bytes covered by (offset, length) ranges, overlaps counted once."""
    total, end = 0, -1
    for off, ln in sorted(ranges):
        if off + ln > end:
            total += off + ln - max(off, end)
            end = off + ln
    return total


# -- state --------------------------------------------------------------------------------
def _load_pending(store: Store) -> dict[str, float]:
    try:
        doc = json.loads(store.get(PENDING))
        return {str(k): float(v) for k, v in doc.get("candidates", {}).items()}
    except NotFoundError:
        return {}
    except (ValueError, AttributeError, TypeError):
        log.warning("%s in %s is malformed; starting a new candidate list", PENDING, store.url)
        return {}


def _save_pending(store: Store, pending: dict[str, float]) -> None:
    doc = {"format": 1, "candidates": dict(sorted(pending.items())), "updated": time.time()}
    store.put(PENDING, json.dumps(doc).encode())


def _list_objects(store: Store) -> dict[str, ObjectInfo]:
    out: dict[str, ObjectInfo] = {}
    for prefix in OBJECT_PREFIXES:
        for info in store.list(prefix):
            if parse_object_key(info.key):
                out[info.key] = info
    return out


# -- sweep --------------------------------------------------------------------------------
def gc_store(store: Store, grace: float = 3600.0, dry_run: bool = False, jobs: int = 8,
             repack_threshold: float = 0.5, repack: bool = True) -> GcReport:
    """Collect garbage in one store; see the module docstring for the protocol."""
    store = RetryingStore(store)  # a retrying store is unwrapped, never wrapped twice
    now = time.time()
    report = GcReport(store.url, dry_run, grace)
    leases = read_leases(store)
    report.leases_live = sum(1 for le in leases if le.live(now))
    objects = _list_objects(store)  # before marking: anything written later is not listed
    live = mark(store, report)
    _pack_usage(store, live, objects, report, repack_threshold)
    report.reachable = sum(1 for k in objects if k in live)
    report.reachable_bytes = sum(i.size for k, i in objects.items() if k in live)
    pending = _load_pending(store)
    report.resurrected = sum(1 for k in pending if k in live)
    new_pending: dict[str, float] = {}
    for key, info in objects.items():
        if key in live:
            continue
        report.unreachable += 1
        if key in pending:
            new_pending[key] = pending[key]
        elif now - info.mtime >= grace + (MTIME_SLACK if grace > 0 else 0.0):
            new_pending[key] = now
            report.marked.append(key)
        else:
            report.recent += 1
    due = [k for k, t in new_pending.items() if now - t >= grace]
    report.waiting = len(new_pending) - len(due)
    if report.dangling:
        report.deferred = "some refs or pins cannot be walked; nothing is deleted until fixed"
        due = []
    elif report.unreadable:
        report.deferred = "some live indexes cannot be read; no pack is deleted until fixed"
        due = [k for k in due if not k.startswith("packs/")]
    if dry_run:
        report.would_delete = sorted(due)
        report.freed_bytes = sum(objects[k].size for k in due)
        return report
    for le in leases:
        if not le.live(now - grace):  # expired longer than the grace ago: its writer is gone
            store.delete(le.key)
            report.leases_removed += 1
    if repack and report.repack_candidates and not report.dangling and not report.unreadable:
        from .repack import repack as do_repack

        # the old packs stay live this run (marked above); the next run collects them
        report.repacked = asdict(do_repack(store, {c["pack"] for c in report.repack_candidates}))
    _save_pending(store, new_pending)  # phase 1 is durable before anything is deleted
    if not report.leases_live:
        report.temp_files_removed = _remove_stale_temp(store, now - max(grace, _ttl()))
    if due:
        _delete_phase(store, due, objects, new_pending, report, jobs)
    return report


def _delete_phase(store: Store, due: list[str], objects: dict[str, ObjectInfo],
                  pending: dict[str, float], report: GcReport, jobs: int) -> None:
    ttl = _ttl()
    started = time.time()
    with GcMarker(store) as marker:  # first the marker, then the leases
        live_leases = [le for le in read_leases(store) if le.live()]
        if live_leases:
            report.deferred = (f"{len(live_leases)} writer(s) hold a lease "
                               f"({', '.join(sorted({le.purpose for le in live_leases}))}); "
                               "candidates are deleted by a later run")
            return
        recheck = GcReport(store.url, False, report.grace)
        live = mark(store, recheck)  # refs committed before the leases were read are seen
        if recheck.dangling:
            report.dangling = recheck.dangling
            report.deferred = "some refs or pins cannot be walked; nothing is deleted until fixed"
            return
        for key in [k for k in due if k in live]:
            pending.pop(key, None)
            report.resurrected += 1
        doomed = [k for k in due if k not in live]
        deadline = started + ttl / 2  # stop well before writers stop waiting for us

        def delete(key: str) -> str | None:
            # and only while the marker's heartbeat is fresh (a stalled gc stops itself)
            if time.time() > deadline or not marker.may_delete():
                return None
            store.delete(key)
            return key

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            gone = [k for k in pool.map(delete, _packs_last(doomed)) if k]
        for key in gone:
            pending.pop(key, None)
            report.deleted.append(key)
            report.freed_bytes += objects[key].size
        if len(gone) < len(doomed):
            report.deferred = "stopped deleting before the gc marker expired; run gc again"
        _save_pending(store, pending)


def _remove_stale_temp(store: Store, before: float) -> int:
    """Temporary files a killed writer left in a file:// store's staging directory. Only
    run with no live lease; a writer still writing keeps its file's mtime fresh."""
    if not store.url.startswith("file:"):
        return 0  # other stores stage in the user's data dir, shared with other stores
    removed = 0
    for path in Path(store.staging_dir()).glob("*"):
        try:
            if path.is_file() and path.stat().st_mtime < before:
                path.unlink()
                removed += 1
        except OSError:
            continue  # renamed into place or removed meanwhile
    return removed


def _packs_last(keys: Iterable[str]) -> list[str]:
    """Manifests first, then indexes, then packs: the reverse of the commit order, so an
    interrupted sweep never leaves a manifest whose packs are gone."""
    order = {"manifests": 0, "indexes": 1, "packs": 2}
    return sorted(keys, key=lambda k: (order.get(k.split("/", 1)[0], 3), k))
