"""`dsec build`: load a set of specs, check them all, order them by dependency, and build
each one that is not already in the store with the same inputs.

Nothing is written to the store until every spec has been validated. Each layer is committed
by writing its ref after its packs, index and manifest, so a build killed at any point
leaves at most unreferenced objects for gc.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..core import validate
from ..core.config import load_config
from ..core.digests import object_key
from ..core.errors import NotFoundError, SpecError, UsageError
from ..core.files import remove_tree
from ..core.gcpause import gc_paused
from ..format import canonical
from ..format.index import CONTENT_VERSION
from ..format.manifest import Manifest, load_manifest
from ..format.refs import commit_ref, get_ref
from ..push.dedup import KnownChunks
from ..push.stores import default_store_url, open_store
from ..push.stores.base import Store
from .report import BuildReport, Built
from .spec import OCI_PREFIX, Spec, find_specs, load_spec

# the steps (and the sandbox runner under them), the image writer and the layer writer (with
# the compiled chunker) are imported only when something is built: a no-op build skips them
if TYPE_CHECKING:
    from ..format.index import LayerIndex
    from .dockerfile_build import DockerfileOptions
    from .layer import Progress, WriteStats



#: what the steps make of a spec's inputs; bumped when that changes, so that a cached result
#: of the old rules is not taken for a build under the new ones (2: copy and extract get
#: fixed timestamps)
BUILD_RULES = 2


def _order(specs: list[Spec], store: Store) -> list[Spec]:
    """Topological order; unknown references and cycles are errors naming file and line."""
    by_ref: dict[str, Spec] = {}
    for s in specs:
        if s.ref in by_ref:
            other = by_ref[s.ref]
            raise SpecError(f"{s.ref} is also defined in {other.path}:{other.line}",
                            path=str(s.path), line=s.line)
        by_ref[s.ref] = s
    for s in specs:
        for ref, line in s.deps:
            dep = by_ref.get(ref)
            if dep is not None:
                if s.kind == "image" and dep.kind != "layer":
                    raise SpecError(f"{ref} is an image; images stack layers only",
                                    path=str(s.path), line=line)
                continue
            try:
                m = load_manifest(store, get_ref(store, ref).manifest)
            except NotFoundError:
                raise SpecError(f"unknown layer {ref}: not among the specs being built nor in "
                                f"{store.url}", path=str(s.path), line=line) from None
            if m.kind != "layer":
                raise SpecError(f"{ref} is an image; only layers can be stacked",
                                path=str(s.path), line=line)
    order: list[Spec] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(s: Spec, chain: list[Spec]) -> None:
        if state.get(s.ref) == 2:
            return
        if state.get(s.ref) == 1:
            cycle = chain[chain.index(s):] + [s]
            raise SpecError("dependency cycle: " + " -> ".join(
                f"{c.ref} ({c.path}:{c.line})" for c in cycle), path=str(s.path), line=s.line)
        state[s.ref] = 1
        for ref, _ in s.deps:
            if ref in by_ref:
                visit(by_ref[ref], chain + [s])
        state[s.ref] = 2
        order.append(s)

    for s in sorted(specs, key=lambda x: x.ref):
        visit(s, [])
    return order


def _fingerprint(spec: Spec) -> str:
    """Cheap identity of a spec's inputs: path, size, mtime, ctime, mode and inode of every
    source path (format/tree.py `stat_listing`, which says what it relies on). No contents
    are read, so a no-op build of a large tree costs one stat per path."""
    from ..format.tree import stat_listing

    h = hashlib.sha256()
    for step in spec.steps:
        src = step.args.get("src")
        if src is None:
            continue
        h.update(stat_listing(str(src)))
    return h.hexdigest()


def _listing(spec: Spec) -> Future[str]:
    """`_fingerprint` on a thread of its own (the compiled listing runs without the GIL), for
    a build that cannot be a cache hit: the inputs are listed while the build scans them.
    Its result is taken before any input's contents are read (see `_build_layer`), so every
    path is listed before it is read, as when the listing comes first: a write to an input
    during the build changes the next build's key."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="build-listing")
    try:
        return pool.submit(_fingerprint, spec)
    finally:
        pool.shutdown(wait=False)


class _BuildCache:
    """Local: (spec, inputs, dependencies) -> manifest digest, per store."""

    def __init__(self, data_dir: Path, store: Store) -> None:
        sid = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        self.dir = data_dir / "build-cache" / sid
        self.dir.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> str | None:
        try:
            return (self.dir / key).read_text().strip()
        except FileNotFoundError:
            return None

    def seen(self, ident: str) -> bool:
        """Whether a build of this spec and dependencies (any inputs) was recorded."""
        return (self.dir / f"seen-{ident}").exists()

    def put(self, key: str, manifest: str, ident: str) -> None:
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(manifest)
        os.replace(tmp, self.dir / key)
        (self.dir / f"seen-{ident}").touch()


def build(paths: Sequence[str | Path] | None = None, store: str | Store | None = None, *,
          force: bool = False, progress: Progress | None = None,
          on_log: Callable[[str], None] | None = None,
          chunk_sha256: bool = False, replace: bool = False, as_ref: str = "",
          build_args: dict[str, str] | None = None, target: str = "",
          squash: bool = False) -> BuildReport:
    """Build the specs in ``paths`` (default ``layerspecs/``) into a store.

    A ``name@version`` is immutable: a build whose result differs from what the store's ref
    already names raises `RefConflictError` (exit 2, both digests named) unless ``replace``
    is given; an unchanged rebuild is a cache hit. ``chunk_sha256`` adds a sha256 per chunk
    to new layers, for stores shared across trust domains (docs/format.md). With ``as_ref``
    the one path is a Dockerfile (or a folder holding one), built into that image with
    ``build_args``, ``target`` and ``squash`` (docs/dockerfile.md)."""
    from ..push.lease import WriterLease

    if not isinstance(store, Store):  # the URL checked first, then the specs, then opened
        store = default_store_url() if store is None else validate.store_url(store)
    if as_ref:  # a Dockerfile (docs/dockerfile.md), built on its own
        from .dockerfile_build import DockerfileOptions

        opts = DockerfileOptions(as_ref, dict(build_args or {}), target, squash)
        return _build_dockerfile(paths, store, opts, replace, progress, on_log)
    if build_args or target or squash:
        raise UsageError("build args, a target stage and squash are for a Dockerfile build "
                         "(give it --as NAME@VERSION)")
    # the specs before the store: a bad one stops the build before anything is opened
    specs = [load_spec(p) for p in find_specs([Path(p) for p in paths or ["layerspecs"]])]
    st = store if isinstance(store, Store) else open_store(store)
    # a build reuses chunks of packs the store holds: the lease keeps store gc from
    # deleting them until its refs are written (docs/stores.md, "gc protocol")
    with WriterLease(st, "build"):
        return _build(specs, st, force=force, progress=progress, on_log=on_log,
                      chunk_sha256=chunk_sha256, replace=replace)


def _build_dockerfile(paths: Sequence[str | Path] | None, store: str | Store,
                      opts: DockerfileOptions,
                      replace: bool, progress: Progress | None,
                      on_log: Callable[[str], None] | None) -> BuildReport:
    from ..push.lease import WriterLease
    from .dockerfile import load_dockerfile
    from .dockerfile_build import build_dockerfile

    if not paths or len(paths) != 1:
        raise UsageError("a Dockerfile build takes one Dockerfile")
    path = Path(paths[0])
    if path.is_dir():
        path = path / "Dockerfile"
    load_dockerfile(path)  # checked before the store is opened
    st = store if isinstance(store, Store) else open_store(store)
    with WriterLease(st, "build"):
        return build_dockerfile(path, st, opts, replace=replace, progress=progress,
                                on_log=on_log)


def _build(specs: list[Spec], st: Store, *, force: bool = False,
           progress: Progress | None = None, on_log: Callable[[str], None] | None = None,
           chunk_sha256: bool = False, replace: bool = False) -> BuildReport:
    cfg = load_config()
    report = BuildReport(store=st.url)
    _import_oci_deps(specs, st, report)
    order = _order(specs, st)
    cache = _BuildCache(Path(cfg.data_dir), st)
    digests: dict[str, str] = {}  # ref -> manifest digest, for this run
    known: KnownChunks | None = None
    #: indexes written this run whose chunks the next layer's writer should know; added to
    #: `known` only when a next layer is built (the last layer's never need to be)
    unadded: list[LayerIndex] = []

    def dep_digest(ref: str) -> str:
        return digests[ref] if ref in digests else get_ref(st, ref).manifest

    # images of Dockerfiles last: their FROM may name what the other specs build
    order = [s for s in order if s.dockerfile is None] + [s for s in order if s.dockerfile]
    for spec in order:
        if spec.dockerfile is not None:
            from .dockerfile_build import DockerfileOptions, build_dockerfile

            opts = DockerfileOptions(spec.ref, spec.build_args, spec.target, spec.squash)
            sub = build_dockerfile(spec.dockerfile, st, opts, replace=replace,
                                   progress=progress, on_log=on_log)
            report.items += sub.items
            report.pinned.update(sub.pinned)
            digests[spec.ref] = sub.items[-1].manifest
            continue
        started = time.monotonic()
        deps = [dep_digest(r) for r, _ in spec.deps]
        ident = {"format": CONTENT_VERSION, "rules": BUILD_RULES, "spec": spec.doc,
                 "deps": deps, "sde": os.environ.get("SOURCE_DATE_EPOCH", "0"),
                 "sha": chunk_sha256}
        seen = hashlib.sha256(canonical.dumps(ident)).hexdigest()
        # a layer never built here as it is (same spec and dependencies) cannot be a cache
        # hit: its inputs are listed on a thread while the build scans them
        listing = (_listing(spec) if spec.kind == "layer" and (force or not cache.seen(seen))
                   else None)
        key = "" if listing is not None else hashlib.sha256(canonical.dumps({
            **ident, "inputs": _fingerprint(spec) if spec.kind == "layer" else ""})).hexdigest()
        hit = None if force or listing is not None else cache.get(key)
        if hit and st.has(object_key("manifests", hit)):
            m = load_manifest(st, hit)
            replaced = _point_ref(st, spec, hit, replace)
            digests[spec.ref] = hit
            report.items.append(Built(spec.ref, spec.kind, hit, m.content_digest, True, m.size,
                                      m.stored_size, spec=str(spec.path), replaced=replaced))
            continue
        if spec.kind == "image":
            digest, m, warnings = _build_image(st, spec, deps)
            report.warnings += [f"{spec.ref}: {w}" for w in warnings]
            item = Built(spec.ref, "image", digest, "", False, m.size, m.stored_size)
        else:
            if known is None:
                known = KnownChunks.load(st, Path(cfg.data_dir) / "chunk-tables")
            for ix in unadded:
                known.add_index(ix)
            unadded.clear()
            digest, m, stats, index = _build_layer(st, spec, deps, known, Path(cfg.data_dir),
                                                   progress, on_log, chunk_sha256, listing)
            unadded.append(index)
            if listing is not None:
                key = hashlib.sha256(canonical.dumps(
                    {**ident, "inputs": listing.result()})).hexdigest()
            item = Built(spec.ref, "layer", digest, m.content_digest, False, m.size,
                         m.stored_size, stats.new_bytes, stats.new_chunks, stats.reused_chunks)
        item.replaced = _point_ref(st, spec, digest, replace)
        cache.put(key, digest, seen)
        digests[spec.ref] = digest
        item.seconds = time.monotonic() - started
        item.spec = str(spec.path)
        report.items.append(item)
    return report


def _import_oci_deps(specs: list[Spec], st: Store, report: BuildReport) -> None:
    """``oci:HOST/REPO:TAG`` in ``from:`` or ``layers:`` stands for the layers of that image,
    bottom first: it is imported (layers already in the store are not read again) and
    replaced by their refs; the build report pins the manifest digest it resolved to. All
    the images the specs name are imported in one run (`ociimport.import_images`: a layer
    two of them share is read once)."""
    wanted: dict[str, tuple[Spec, int]] = {}  # ref -> where it is first named
    for s in specs:
        for ref, line in s.deps:
            if ref.startswith(OCI_PREFIX):
                wanted.setdefault(ref, (s, line))
    if not wanted:
        return  # nothing to import: the importer's modules stay unloaded
    from .ociimport import import_images

    run = import_images(st, [ref[len(OCI_PREFIX):] for ref in wanted], as_ref="")
    for source, e in run.failed:
        ref = OCI_PREFIX + source
        s, line = wanted[ref]
        if isinstance(e, UsageError):
            raise SpecError(f"{ref}: {e.message}", path=str(s.path), line=line) from None
        raise e
    layers: dict[str, list[str]] = {}
    for r in run.reports:
        ref = OCI_PREFIX + r.source
        layers[ref] = [x.ref for x in r.layers]
        report.pinned[ref] = r.source_digest
    for s in specs:
        deps: list[tuple[str, int]] = []
        for ref, line in s.deps:
            deps += [(x, line) for x in layers[ref]] if ref in layers else [(ref, line)]
        s.deps = deps


def _point_ref(st: Store, spec: Spec, digest: str, replace: bool) -> str:
    """Commit the spec's ref; returns the manifest it named before, if ``replace`` moved it."""
    return commit_ref(st, spec.name, spec.version, digest, replace=replace,
                      verb=f"this build of {spec.path} made")


def _build_layer(st: Store, spec: Spec, deps: list[str], known: KnownChunks, data_dir: Path,
                 progress: Progress | None, on_log: Callable[[str], None] | None,
                 chunk_sha256: bool, listing: Future[str] | None = None
                 ) -> tuple[str, Manifest, WriteStats, LayerIndex]:
    from .layer import layer_manifest, write_layer
    from .steps import STAGED_STEPS, build_tree, clean_stale_staging, make_staging

    bases = [load_manifest(st, d) for d in deps]
    base_env: dict[str, str] = {}
    for b in bases:
        base_env.update(b.env)
    lowers: list[Path] = []
    if any(s.kind in STAGED_STEPS for s in spec.steps):
        from ..push.materialize import LayerCache

        cache = LayerCache(Path(load_config().state_dir))
        lowers = [cache.ensure(st, b, d) for d, b in zip(deps, bases, strict=True)]
    tmp_root = data_dir / "tmp"
    clean_stale_staging(tmp_root)  # a build killed before may have left a mounted overlay
    staging = make_staging(tmp_root)
    try:
        if listing is not None and any(s.kind != "copy" for s in spec.steps if "src" in s.args):
            listing.result()  # those steps read their inputs while the tree is made
        with gc_paused():
            scanned = build_tree(spec, staging, lowers, base_env, on_log)
            if listing is not None:
                listing.result()  # a copy step's files are read from here on
            index, stats = write_layer(st, scanned, known=known, progress=progress,
                                       crypto_digests=chunk_sha256)
    finally:
        remove_tree(staging)
    digest, m = layer_manifest(st, index, name=spec.name, version=spec.version,
                               spec_digest=spec.digest(), base=deps, env=spec.env,
                               workdir=spec.workdir)
    return digest, m, stats, index


def _build_image(st: Store, spec: Spec, layers: list[str]) -> tuple[str, Manifest, list[str]]:
    from .image import base_warnings, write_image

    ms = [load_manifest(st, d) for d in layers]
    digest, m = write_image(st, spec.name, spec.version, layers, env=spec.env,
                            workdir=spec.workdir, spec_digest=spec.digest(), manifests=ms,
                            annotations=spec.annotations())
    return digest, m, base_warnings(layers, ms)
