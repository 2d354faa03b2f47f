"""Copy layers and images between stores: the smart layer written once above every store.

Only what the destination lacks is sent; objects move in commit order (packs, indexes,
manifests) with a bounded number in flight; every object read is checked against its
sha256 before it is written; transient failures are retried (`dsec_cli.push.retry`); the
ref is written last, so an interrupted copy publishes nothing and a rerun resumes where it
stopped. The destination is held under a writer lease so store gc never deletes an object
this copy decided to reuse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.digests import parse_object_key, parse_ref, verify_sha256
from ..core.errors import StoreError
from ..format.closure import closure
from ..format.refs import check_ref, commit_ref, get_ref
from .lease import WriterLease
from .stores.base import Store
from .stores.retrying import RetryingStore

log = logging.getLogger(__name__)
DEFAULT_JOBS = 8
KIND_ORDER = ("packs", "indexes", "manifests")


@dataclass
class Progress:
    """Counts so far; `total` fields are known once the destination has been checked."""

    objects_done: int = 0
    objects_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0


ProgressFn = Callable[[Progress], None]


@dataclass
class RefResult:
    ref: str
    manifest: str
    objects: int  # in the closure
    sent: int  # of those, copied by this run
    replaced: str = ""  # with replace: the manifest the destination's ref named before


@dataclass
class TransferReport:
    source: str
    destination: str
    refs: list[RefResult] = field(default_factory=list)
    objects_total: int = 0
    objects_sent: int = 0
    objects_present: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mb_per_s"] = round(self.bytes_sent / 1e6 / self.seconds, 2) if self.seconds else 0
        return d


class _Counter:
    def __init__(self, total_objects: int, total_bytes: int, fn: ProgressFn | None) -> None:
        self.p = Progress(0, total_objects, 0, total_bytes)
        self.fn = fn
        self.lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.p.objects_done += 1
            self.p.bytes_done += nbytes
            snapshot = Progress(**asdict(self.p))
        if self.fn:
            self.fn(snapshot)


def _parallel(jobs: int, fn: Callable[[str], Any], items: Sequence[str]) -> list[Any]:
    """Run fn over items with at most `jobs` in flight; the first error cancels the rest."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="dsec-xfer") as pool:
        futures: list[Future[Any]] = [pool.submit(fn, item) for item in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                for g in futures:
                    g.cancel()
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def copy_refs(src: Store, dst: Store, refs: Sequence[str], *, jobs: int = DEFAULT_JOBS,
              progress: ProgressFn | None = None, lease: bool = True,
              replace: bool = False) -> TransferReport:
    """Copy each ``name@version`` (a layer or an image with its layers) from src to dst.

    Versions are immutable: a ref that dst already holds with another manifest is a
    `RefConflictError`, raised before anything is copied, unless ``replace`` is given."""
    t0 = time.monotonic()
    # one layer of retries: a retrying store is unwrapped, never wrapped twice
    src, dst = RetryingStore(src), RetryingStore(dst)
    wanted = [(parse_ref(r), get_ref(src, r).manifest) for r in dict.fromkeys(refs)]
    before = {f"{n}@{v}": check_ref(dst, f"{n}@{v}", digest, replace=replace,
                                    verb=f"{src.url} holds") for (n, v), digest in wanted}
    report = TransferReport(src.url, dst.url)
    closures = [closure(src, digest) for _, digest in wanted]
    keys = list(dict.fromkeys(k for c in closures for k in c))
    report.objects_total = len(keys)
    guard = WriterLease(dst, "push") if lease else None
    if guard:
        guard.__enter__()
    try:
        present = _parallel(jobs, dst.has, keys)
        missing = [k for k, here in zip(keys, present, strict=True) if not here]
        report.objects_present = len(keys) - len(missing)
        sizes = _parallel(jobs, lambda k: getattr(src.stat(k), "size", 0), missing)
        counter = _Counter(len(missing), sum(sizes), progress)
        if progress:
            progress(Progress(0, len(missing), 0, sum(sizes)))

        def copy_one(key: str) -> int:
            _, digest = parse_object_key(key) or ("", "")
            data = verify_sha256(src.get(key), digest, f"{key} in {src.url}")
            dst.put(key, data)
            counter.add(len(data))
            return len(data)

        for kind in KIND_ORDER:  # commit order: nothing is written before what it names
            batch = [k for k in missing if k.startswith(kind + "/")]
            report.bytes_sent += sum(_parallel(jobs, copy_one, batch))
        report.objects_sent = len(missing)
        if guard and guard.lost:  # gc may have run without seeing us: check before committing
            gone = [k for k, here in zip(keys, _parallel(jobs, dst.has, keys), strict=True)
                    if not here]
            if gone:
                raise StoreError(f"{len(gone)} objects vanished from {dst.url} while this "
                                 "copy could not renew its lease; nothing was published",
                                 hint="run the same command again")
        for ((name, version), digest), keys_of in zip(wanted, closures, strict=True):
            ref = f"{name}@{version}"
            # the commit point, last; checked again: a writer may have taken it meanwhile
            commit_ref(dst, name, version, digest, replace=replace, verb=f"{src.url} holds")
            sent = len(set(keys_of) & set(missing))
            moved = before[ref] if before[ref] and before[ref] != digest else ""
            report.refs.append(RefResult(ref, digest, len(keys_of), sent, moved))
    finally:
        if guard:
            guard.__exit__(None, None, None)
    report.seconds = time.monotonic() - t0
    log.info("copied %d of %d objects (%d bytes) from %s to %s", report.objects_sent,
             report.objects_total, report.bytes_sent, src.url, dst.url)
    return report
