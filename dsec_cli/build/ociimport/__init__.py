"""OCI and Docker images into dsec: each image layer becomes a dsec layer, the image config
a dsec image (`dsec import`, and the `oci:` images specs and Dockerfiles name).

`import_images` plans each image (its source opened, the manifest for the platform picked,
its config read: `oci.sources`, `oci.manifests`), then runs the wave (`schedule`): each
layer is read into a staged dsec layer (`layers`) and the images are published once their
layers are verified. What a run did is in `reports`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...core.config import load_config
from ...core.digests import parse_ref
from ...core.errors import IntegrityError, UsageError
from ...core.gcpause import gc_paused
from ...format.validate import layer_count_problem
from ...oci.manifests import (
    DIGEST,
    default_name,
    host_platform,
    image_settings,
    layers_of,
    pick_platform,
)
from ...oci.sources import INDEX_TYPES, MANIFEST_TYPES, load_doc, open_source
from ...push.dedup import KnownChunks
from ...push.lease import WriterLease
from ...push.stores.base import Store
from .reports import ImportedLayer, ImportProgress, ImportReport, ImportRun
from .schedule import Plan, Progress, as_dsec_error, read_and_publish, refuse_other_image

__all__ = ["ImportProgress", "ImportReport", "ImportRun", "ImportedLayer", "import_image",
           "import_images"]


def import_image(store: Store, source_text: str, *, as_ref: str | None = None,
                 platform: str | None = None, insecure: bool = False,
                 progress: Callable[[ImportProgress], None] | None = None,
                 replace: bool = False) -> ImportReport:
    """Import an image from a registry, an OCI layout or a docker save tarball; write its
    layers and an image manifest, and point ``as_ref`` (or a name taken from the source) at
    it."""
    run = import_images(store, [source_text], as_ref=as_ref, platform=platform,
                        insecure=insecure, progress=progress, replace=replace)
    if run.failed:
        raise run.failed[0][1]
    return run.reports[0]


#: images planned, read and published together: each wave's layers are read side by side
#: (sharing chunk claims), then its images are published and its staging removed
WAVE_IMAGES = 16


def import_images(store: Store, sources: list[str], *, as_ref: str | None = None,
                  platform: str | None = None, insecure: bool = False,
                  progress: Callable[[ImportProgress], None] | None = None,
                  replace: bool = False) -> ImportRun:
    """Import a library of images in one run: their manifests are read side by side, each
    distinct layer is read once (by ``diff_id``, whatever image lists it) with up to
    `RUN_LAYER_WORKERS` layers of any image at a time, and a chunk met by two layers being read
    at once is compressed once (the second takes it from the first's packs). Images are
    published in source order, each once all its layers are verified; an image that fails
    (unreadable, a digest mismatch, a name taken) is reported in `ImportRun.failed` and
    changes nothing, and the others are imported all the same. ``as_ref`` names the one
    image of a run of one; ``""`` imports the layers without naming the images (what a
    build's `oci:` dependencies take)."""
    if as_ref and len(sources) != 1:
        raise UsageError("--as names one image: import several sources under the names "
                         "their references give")
    if as_ref:
        parse_ref(as_ref)  # before anything is opened
    t0 = time.monotonic()
    run = ImportRun()
    want = platform or host_platform()
    tables = _chunk_tables()
    prog = ImportProgress()  # one for the run, whatever waves it takes
    with WriterLease(store, "import"), gc_paused():
        known = KnownChunks.load(store, tables)
        for at in range(0, len(sources), WAVE_IMAGES):
            _wave(store, sources[at:at + WAVE_IMAGES], as_ref, want, insecure, replace,
                  (progress, prog), known, tables, run)
    run.seconds = time.monotonic() - t0
    return run


def _plan(store: Store, source_text: str, as_ref: str | None, want: str, insecure: bool,
          replace: bool) -> Plan:
    """Open the source, pick the manifest for ``want``, read the config; nothing is written."""
    p = Plan(source_text, t0=time.monotonic(), as_ref=as_ref, replace=replace)
    label = source_text
    try:
        p.source = source = open_source(source_text, insecure)
        label = source.label
        data, media_type, top_digest = source.root()
        doc = load_doc(data, f"{label}: manifest")
        for _ in range(4):  # an index may name an index (a layout's index.json does)
            media_type = doc.get("mediaType") or media_type
            if media_type not in INDEX_TYPES and (media_type in MANIFEST_TYPES
                                                  or "manifests" not in doc):
                break
            desc = pick_platform(doc, want, label)
            data = source.manifest(desc)
            doc = load_doc(data, f"{label}: manifest {desc.digest}")
            media_type, top_digest = desc.media_type, desc.digest
        else:
            raise IntegrityError(f"{label}: image indexes nested too deep")
        config_desc, layers = layers_of(doc, label)
        config = load_doc(source.document(config_desc), f"{label}: image config")
        rootfs = config.get("rootfs") if isinstance(config.get("rootfs"), dict) else {}
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or not all(
                isinstance(d, str) and DIGEST.match(d) for d in diff_ids):
            raise IntegrityError(f"{label}: the config's rootfs.diff_ids do not list "
                                 f"one sha256 digest per layer ({len(layers)} layers)")
        p.env, p.workdir, p.ann = image_settings(config, label)
        p.name, p.version = parse_ref(as_ref) if as_ref else default_name(source)
        problem = layer_count_problem(len(layers))
        if problem:
            raise UsageError(f"{label} ({p.name}@{p.version}): {problem}")
        p.top_digest = top_digest or ""
        if as_ref != "" and not replace:
            refuse_other_image(store, p.name, p.version, p.top_digest)
        p.layers = list(zip(layers, diff_ids, strict=True))
        p.report = ImportReport(source_text, f"{p.name}@{p.version}", "", p.top_digest, want)
    except BaseException as e:
        p.error = as_dsec_error(e, label)
    return p


def _wave(store: Store, sources: list[str], as_ref: str | None, want: str, insecure: bool,
          replace: bool, progress: Progress,
          known: KnownChunks, tables: Path, run: ImportRun) -> None:
    pool = ThreadPoolExecutor(min(len(sources), 4), thread_name_prefix="oci-plan")
    # each image's layers start as soon as its own manifest and config are read, not once
    # every image's are: from a registry far away that is a round trip or three per image
    planned = [pool.submit(_plan, store, s, as_ref, want, insecure, replace) for s in sources]
    try:
        read_and_publish(store, planned, progress, known, tables)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        plans = [f.result() for f in planned if not f.cancelled()]
        for p in plans:
            if p.source is not None:
                p.source.close()
    for p in plans:
        if p.error is not None:
            run.failed.append((p.source_text, p.error))
        else:
            assert p.report is not None
            run.reports.append(p.report)


def _chunk_tables() -> Path:
    """Where this machine caches the chunk tables of a store's indexes (`push.dedup`)."""
    return Path(load_config().data_dir) / "chunk-tables"
