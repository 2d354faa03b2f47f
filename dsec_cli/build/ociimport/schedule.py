"""The run that imports a wave of images: each distinct layer read once (by ``diff_id``),
up to `RUN_LAYER_WORKERS` at a time, while the wave's images are published in source order,
each once all its layers are verified; a layer that fails fails every image that lists it,
and the others are published all the same."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...core.errors import DsecError, IntegrityError, NotFoundError, RefConflictError
from ...format.manifest import Manifest, load_manifest
from ...format.refs import commit_ref, get_ref
from ...oci.sources import Descriptor, Source
from ...push import retry
from ...push.dedup import KnownChunks
from ...push.stores.base import Store
from ..image import write_image
from ..layer import ClaimLost, Claims, _Writer
from .layers import StagedLayer, existing_layer, remove_dirs, stage_layer
from .reports import ImportedLayer, ImportProgress, ImportReport

#: layers read at the same time (each on its own read-ahead thread and compression pool):
#: enough to overlap one layer's download and verification with another's chunking
RUN_LAYER_WORKERS = max(2, min(6, 2 * (os.cpu_count() or 1)))
#: a layer read while this many others are read is read lean (`stage_layer`): a layer read
#: on four threads keeps about two cores busy (its inflate beside its parser). While a run
#: of several images is still being planned, every layer is read lean: more are coming
LEAN_BESIDE = max(1, (os.cpu_count() or 1) // 2)


#: what a run reports progress to, and the run's totals so far
Progress = tuple[Callable[[ImportProgress], None] | None, ImportProgress]


@dataclass
class Plan:
    """One image of a run: what its manifest and config say, what became of it."""

    source_text: str
    source: Source | None = None
    name: str = ""
    version: str = ""
    top_digest: str = ""
    layers: list[tuple[Descriptor, str]] = field(default_factory=list)  # (blob, diff_id)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    ann: dict[str, str] = field(default_factory=dict)
    report: ImportReport | None = None
    error: DsecError | None = None
    t0: float = 0.0
    as_ref: str | None = None
    replace: bool = False


#: what an image's failure may be besides a DsecError: input that broke a decoder
INPUT_ERRORS = (OSError, ValueError, KeyError, TypeError)


def as_dsec_error(e: BaseException, label: str) -> DsecError:
    if isinstance(e, DsecError):
        return e
    if isinstance(e, INPUT_ERRORS):
        return IntegrityError(f"{label}: {type(e).__name__}: {e}")
    raise e


class _Run:
    """The layers of one wave being read: who needs each, what became of it, every writer
    (a pack of one layer may be named by another's index), the progress of the whole."""

    def __init__(self, progress: Progress, several: bool) -> None:
        self.lock = threading.Lock()
        self.progress, self.prog = progress
        self.needed_by: dict[str, list[Plan]] = {}
        self.done: dict[str, StagedLayer | ImportedLayer] = {}  # layers read or present
        self.imported: dict[str, ImportedLayer] = {}  # layers published by this run
        self.manifests: dict[str, Manifest] = {}  # the layers' manifests, not read back
        self.settled: dict[str, threading.Event] = {}  # layers being read: set once ended
        self.closing = False
        self.writers: list[tuple[_Writer, Path]] = []
        self.claims: Claims = {}
        self.interrupted: BaseException | None = None
        self.errors: dict[str, DsecError] = {}  # layers that failed, and why
        #: False while images are still being planned: until then a layer no image yet
        #: read wants may still be wanted by the next, so no read is stopped for that
        self.all_planned = False
        self.several = several  # the wave has more than one image

    def plan(self, p: Plan) -> None:
        """An image joins the run: its layers and bytes count in the totals."""
        if p.error is None:
            with self.lock:
                self.prog.objects_total += len(p.layers)
                self.prog.bytes_total += sum(d.size for d, _ in p.layers)

    def join(self, p: Plan, diff_id: str) -> bool:
        """``p`` needs a layer an earlier image of the run needs too: True when it is (or
        is being) read for that image; a layer that already failed fails ``p`` now."""
        with self.lock:
            if diff_id not in self.needed_by:
                return False
            self.needed_by[diff_id].append(p)
            if diff_id in self.errors:
                p.error = p.error or self.errors[diff_id]
            return True

    def tick(self, p: Plan, n: int) -> None:
        with self.lock:
            self.prog.bytes_done += n
            assert p.report is not None
            p.report.bytes_read += n
            if self.progress:
                self.progress(self.prog)

    def skip(self, n: int) -> None:
        """Bytes of a layer not read (in the store, or read for another image)."""
        with self.lock:
            self.prog.bytes_done += n

    def layer_done(self, count: int = 1) -> None:
        with self.lock:
            self.prog.objects_done += count
            if self.progress:
                self.progress(self.prog)

    def wanted(self, diff_id: str) -> bool:
        """False once every image that lists the layer has failed (or the run is being
        given up): its read stops."""
        if self.closing:
            return False
        return not self.all_planned or any(p.error is None for p in self.needed_by[diff_id])

    def fail(self, diff_id: str, e: DsecError) -> None:
        with self.lock:  # with `join`: an image that joins later fails too
            self.errors[diff_id] = e
            for p in self.needed_by[diff_id]:
                p.error = p.error or e
            if diff_id in self.settled:
                self.settled[diff_id].set()


def read_and_publish(store: Store, planned: list[Future[Plan]],
                      progress: Progress, known: KnownChunks,
                      tables: Path) -> None:
    """Read the wave's missing layers, up to `RUN_LAYER_WORKERS` at once, each image's as
    soon as it is planned, while its images are published in source order, each as soon as
    its own layers are verified."""
    r = _Run(progress, several=len(planned) > 1)
    plans: list[Plan] = []
    pool = ThreadPoolExecutor(RUN_LAYER_WORKERS, thread_name_prefix="oci-import")
    try:
        reader = _LayerReader(store, r, known, pool)
        for fut in planned:
            p = fut.result()
            plans.append(p)
            r.plan(p)
            if p.error is not None:
                continue
            for desc, diff_id in p.layers:
                if r.join(p, diff_id):
                    r.skip(desc.size)
                    r.layer_done()
                    continue
                r.needed_by[diff_id] = [p]
                have = existing_layer(store, diff_id)  # by diff_id: nothing is downloaded
                if have is not None:
                    d, m = have
                    r.manifests[d] = m
                    r.done[diff_id] = ImportedLayer(m.ref, d, m.content_digest, diff_id,
                                                    desc.digest or "", m.size, m.stored_size,
                                                    True)
                    r.skip(desc.size)
                    r.layer_done()
                else:
                    r.settled[diff_id] = threading.Event()
                    reader.read(p, desc, diff_id, r.claims)
        r.all_planned = True
        at = 0
        while at < len(plans):
            for _, diff_id in plans[at].layers:
                if diff_id in r.settled:
                    r.settled[diff_id].wait()
            # with it, every image after it whose layers have all ended too: layers read side
            # by side end together, and their images are published as one
            end = at + 1
            while end < len(plans) and all(r.settled[d].is_set() for _, d in plans[end].layers
                                           if d in r.settled):
                end += 1
            if r.interrupted is not None:
                raise r.interrupted
            _publish_ready(store, [p for p in plans[at:end] if p.error is None], r, tables)
            at = end
    finally:
        r.closing = True  # layers no image waits for stop at their next piece
        pool.shutdown(wait=True, cancel_futures=True)
        writers = list(r.writers)
        published = {d for w, _ in writers if w.published for d in w.written}
        unpublished = {d for w, _ in writers for d in w.written} - published
        if unpublished:  # later waves must not take chunks from packs now discarded
            known.drop_packs(unpublished)
        for w, _ in writers:
            w.abort()
        remove_dirs([path for _, path in writers])


class _LayerReader:
    """Reads one layer of a wave on the pool and records what became of it as it ends: a
    failure fails every image that lists the layer (and stops, at their next piece, the
    reads no other image needs); a layer whose claimed chunk came from a layer that failed
    is read again, without claims."""

    def __init__(self, store: Store, r: _Run, known: KnownChunks,
                 pool: ThreadPoolExecutor) -> None:
        self.store, self.r, self.known, self.pool = store, r, known, pool
        self.policy = retry.RetryPolicy.from_env()  # resolved once: it reads the config files
        self.lock = threading.Lock()
        self.reading = 0  # layers being read now

    def read(self, p: Plan, desc: Descriptor, diff_id: str, claims: Claims | None) -> None:
        try:
            fut = self.pool.submit(self._stage, p, desc, diff_id, claims)
        except RuntimeError:  # the pool is shutting down: the run is being given up
            self.r.fail(diff_id, IntegrityError(f"{p.source_text}: import stopped"))
            return
        fut.add_done_callback(lambda f: self._settle(p, desc, diff_id, f))

    def _stage(self, p: Plan, desc: Descriptor, diff_id: str, claims: Claims | None
               ) -> StagedLayer:
        r, source = self.r, p.source
        assert source is not None

        def tick_or_stop(n: int) -> None:
            if not r.wanted(diff_id):
                raise _Stopped
            r.tick(p, n)

        if not r.wanted(diff_id):
            raise _Stopped
        # a layer read while the layers being read already fill the cores (or while more
        # images of the run are being planned, whose layers will) is read lean, on its own
        # thread. Each stage on a thread of its own lets one layer use two cores; beside
        # other layers it only adds threads waiting for the GIL and for a core (docs/oci.md,
        # "Measured")
        with self.lock:
            lean = self.reading >= LEAN_BESIDE or (r.several and not r.all_planned)
            self.reading += 1
        try:
            # a connection that breaks mid-layer reads the layer again (transient failures
            # only, under the one retry policy); a source whose blobs share one file
            # position (a `docker save` tarball) opens them one at a time
            return retry.call(lambda: stage_layer(self.store, source, desc, diff_id,
                                                  known=self.known, tick=tick_or_stop,
                                                  claims=claims, writers=r.writers,
                                                  lean=lean),
                              f"importing layer {desc.digest or diff_id}", self.policy)
        finally:
            with self.lock:
                self.reading -= 1

    def _settle(self, p: Plan, desc: Descriptor, diff_id: str, fut: Future[StagedLayer]
                ) -> None:
        r = self.r
        try:
            r.done[diff_id] = fut.result()
            r.layer_done()
        except ClaimLost:
            self.read(p, desc, diff_id, None)  # alone: no claims left to lose
            return
        except (_Stopped, CancelledError):
            r.fail(diff_id, IntegrityError(f"{p.source_text}: import stopped"))
        except (DsecError, *INPUT_ERRORS) as e:
            r.fail(diff_id, as_dsec_error(e, p.source.label if p.source else p.source_text))
        except BaseException as e:  # noqa: BLE001 - an interrupt: raised by the run
            r.interrupted = r.interrupted or e
            r.fail(diff_id, IntegrityError(f"{p.source_text}: interrupted"))
        r.settled[diff_id].set()


def _publish_ready(store: Store, ready: list[Plan], r: _Run, tables: Path) -> None:
    """Publish images whose layers are all verified, in source order: only now does the
    store change. Several images ready at once share their writes (`_publish_images`);
    should that fail, each is published again on its own, so that one image's failure
    stays its own."""
    if len(ready) > 1:
        try:
            _publish_images(store, ready, r, tables)
            return
        except (DsecError, *INPUT_ERRORS):
            pass  # the batch showed nothing (`Store.write_batch`): one image at a time
    for p in ready:
        if p.error is None and p.report is not None and not p.report.manifest:
            try:
                _publish_images(store, [p], r, tables)
            except (DsecError, *INPUT_ERRORS) as e:
                p.error = as_dsec_error(e, p.source_text)


def _publish_images(store: Store, ps: list[Plan], r: _Run, tables: Path) -> None:
    """The packs of every layer the images name (those of the layers they took chunks from
    too), uploaded side by side; then each layer's index, manifest and ref, each image's
    manifest and then the images' refs, made durable together (one `Store.write_batch`,
    shown in that order). An image whose name was taken meanwhile fails alone (`p.error`;
    its objects are left for gc); a batch that fails raises, and shows none of them."""
    owners = {d: w for w, _ in r.writers if w.ok for d in w.written}
    writers: dict[int, _Writer] = {}
    for p in ps:
        for _, diff_id in p.layers:
            x = r.done[diff_id]
            if isinstance(x, StagedLayer) and diff_id not in r.imported:
                writers[id(x.w)] = x.w
                for pack in x.index.packs:  # chunks taken from other layers' packs
                    owner = owners.get(pack)
                    if owner is not None:
                        writers[id(owner)] = owner
    for w in writers.values():
        w.start_publish()
    for w in writers.values():
        w.publish()
    #: layers these images publish: known to later images only once the batch is durable
    #: (a batch that fails shows none of its objects, and a later image publishes them)
    newly: dict[str, ImportedLayer] = {}
    named: list[tuple[Plan, str, list[ImportedLayer]]] = []
    with store.write_batch():  # the refs after every object: shown after them, too
        made = [_image_objects(store, p, r, tables, newly) for p in ps]
        for p, (digest, layers) in zip(ps, made, strict=True):
            try:
                if p.as_ref != "":  # "": the layers only (a spec's `from: [oci:...]`)
                    _set_image_ref(store, p.name, p.version, digest, p.replace)
            except (DsecError, *INPUT_ERRORS) as e:
                p.error = as_dsec_error(e, p.source_text)
                continue
            named.append((p, digest, layers))
    r.imported.update(newly)
    for p, digest, layers in named:
        assert p.report is not None
        p.report.layers = layers
        p.report.manifest = digest
        p.report.seconds = time.monotonic() - p.t0


def _image_objects(store: Store, p: Plan, r: _Run, tables: Path,
                   newly: dict[str, ImportedLayer]) -> tuple[str, list[ImportedLayer]]:
    """Put an image's new layers (index, manifest, ref; their packs are in) and its
    manifest, inside the caller's write batch; return the manifest digest and the layers."""
    layers: list[ImportedLayer] = []
    for desc, diff_id in p.layers:
        x = r.done[diff_id]
        if isinstance(x, StagedLayer):
            earlier = r.imported.get(diff_id) or newly.get(diff_id)
            if earlier is None:
                newly[diff_id] = x.publish(store, tables)
                assert x.published is not None
                r.manifests[x.published[0]] = x.published[1]
                layers.append(newly[diff_id])
            else:  # published for an earlier image of the run (or listed twice)
                layers.append(replace(earlier, digest=desc.digest or "", reused=True,
                                      new_bytes=0))
        else:
            layers.append(replace(x, digest=desc.digest or ""))
    ann = dict(p.ann)
    ann["oci.source"] = p.source_text
    if p.top_digest:
        ann["oci.digest"] = p.top_digest
    digest, _ = write_image(store, p.name, p.version, [x.manifest for x in layers],
                            env=p.env, workdir=p.workdir, annotations=ann,
                            manifests=[r.manifests[x.manifest] for x in layers],
                            created_by=f"dsec import {p.source_text}")
    return digest, layers


class _Stopped(Exception):
    """A layer's read given up because every image that lists it has failed."""


def refuse_other_image(store: Store, name: str, version: str, source_digest: str) -> None:
    """Before anything is read: a ``name@version`` that names an image imported from another
    manifest (or not imported at all) is not moved without ``replace``."""
    try:
        current = get_ref(store, f"{name}@{version}").manifest
    except NotFoundError:
        return
    m = load_manifest(store, current)
    if not source_digest or m.annotations.get("oci.digest") != source_digest:
        raise RefConflictError(f"{name}@{version}", store.url, current,
                               f"an image from {source_digest or 'another source'}",
                               verb="this import would make it")


def _set_image_ref(store: Store, name: str, version: str, digest: str, replace: bool
                   ) -> None:
    """Versions are immutable (`refs.commit_ref`): the same import again makes the same
    manifest, and is a no-op."""
    commit_ref(store, name, version, digest, replace=replace, verb="this import made")
