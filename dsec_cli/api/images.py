"""Images: build specs into a store, list, inspect, export and remove layers and images (what
`dsec build/ls/inspect/export/rmi` call)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..build.builder import build
from ..build.report import BuildReport, Built
from ..core.errors import DsecError, UsageError
from ..format.manifest import Manifest, load_manifest
from ..format.refs import list_refs, resolve
from ..push.dedup import load_index
from ..push.stores import Store, check_exists, open_store

if TYPE_CHECKING:
    from ..push.api import Removed, rmi
    from ..push.materialize import ResolvedImage, export, prepare_image, resolve_image

#: names this module re-exports from modules `dsec build` does not need, imported on first
#: use (they cost a build's start-up about 25 ms)
_LATER = {"Removed": "..push.api", "rmi": "..push.api", "ResolvedImage": "..push.materialize",
          "export": "..push.materialize", "prepare_image": "..push.materialize",
          "resolve_image": "..push.materialize"}


def __getattr__(name: str) -> Any:
    if name in _LATER:
        return getattr(import_module(_LATER[name], __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BuildReport", "Built", "ImageInfo", "Removed", "build", "export", "export_image", "inspect",
    "list_images", "open_store", "optimize_image", "prepare_image", "resolve_image", "rmi", "Store",
]


@dataclass
class ImageInfo:
    ref: str
    kind: str  # layer, image, or broken (then `error` says why)
    digest: str
    size: int
    stored_size: int
    files: int
    updated: float
    layers: list[str] = field(default_factory=list)
    error: str = ""


def _store(store: str | Store | None) -> Store:
    """A store to read (every command here only reads): a typo'd path is an error."""
    if isinstance(store, Store):
        return store
    st = open_store(store)
    check_exists(st)
    return st


def list_images(kind: str = "all", store: str | Store | None = None) -> list[ImageInfo]:
    """Layers and/or images in a store (``kind``: layers, images or all). A ref or manifest
    that cannot be read is listed as ``broken`` with its error, never hiding the rest."""
    if kind not in ("all", "layers", "images"):
        raise UsageError(f"unknown listing {kind!r}: choose layers, images or all")
    st = _store(store)
    out = []
    errors: list[DsecError] = []
    for r in list_refs(st, errors):
        try:
            m = load_manifest(st, r.manifest)
        except DsecError as e:
            out.append(ImageInfo(r.ref, "broken", r.manifest, 0, 0, 0, r.updated,
                                 error=e.message))
            continue
        if kind != "all" and m.kind + "s" != kind:
            continue
        out.append(ImageInfo(r.ref, m.kind, r.manifest, m.size, m.stored_size, m.files,
                             r.updated, [d for d in m.layers]))
    out += [ImageInfo("?", "broken", "", 0, 0, 0, 0.0, error=e.message) for e in errors]
    return out


def inspect(ref: str, store: str | Store | None = None, *, files: bool = False
            ) -> dict[str, Any]:
    """The manifest of a layer or image, with index statistics (and the file list); or, for
    a sandbox id, the sandbox's state as its node reports it."""
    if "@" not in ref and len(ref.removeprefix("sha256:")) != 64:
        from .routing import target  # loads the node: only for a sandbox's image

        return target(ref).describe(ref)
    st = _store(store)
    digest = resolve(st, ref)
    m: Manifest = load_manifest(st, digest)
    doc: dict[str, Any] = {"digest": digest, "store": st.url, "manifest": m.__dict__.copy()}
    if m.kind == "image":
        from ..push.materialize import resolve_image

        img = resolve_image(st, ref)
        doc["layers"] = [{"ref": lm.ref, "digest": d, "size": lm.size,
                          "stored_size": lm.stored_size} for d, lm in img.layers]
        doc["env"] = img.env
        doc["workdir"] = img.workdir
        if files:  # the merged tree, as a sandbox of the image sees it (whiteouts applied)
            from ..format.merge import merge

            stacked = [lm for _, lm in img.layers if lm.index]
            merged = merge([load_index(st, str(lm.index)) for lm in stacked])
            doc["files"] = [{**_file_doc(e), "layer": stacked[n].ref} for e, n in merged]
    elif m.index:
        ix = load_index(st, m.index)
        types: dict[str, int] = {}
        for e in ix.entries:
            types[e.type] = types.get(e.type, 0) + 1
        doc["index"] = {"digest": m.index, "entries": types, "chunks": len(ix.chunks),
                        "packs": len(ix.packs), "chunk_params": ix.params.__dict__}
        if files:
            doc["files"] = [_file_doc(e) for e in ix.entries]
    return doc


def _file_doc(e: Any) -> dict[str, Any]:
    return {"path": e.path, "type": e.type, "mode": oct(e.mode), "uid": e.uid, "gid": e.gid,
            "size": e.size, "target": e.target}


def optimize_image(ref: str, cmd: list[str] | None = None, **options: Any) -> Any:
    """Profiled prefetch: record what ``ref`` reads at start and publish layer versions that
    prefetch it (see `dsec_cli.run.lazy.optimize.optimize_image` for the options)."""
    from ..run.lazy.optimize import optimize_image as optimize

    return optimize(ref, cmd, **options)


def export_image(ref: str, dest: Path, store: str | Store | None = None) -> ResolvedImage:
    """Write an image's merged tree (whiteouts applied) to a new directory or a ``.tar``."""
    from ..push.materialize import export

    return export(_store(store), ref, dest)
