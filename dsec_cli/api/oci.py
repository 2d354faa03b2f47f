"""OCI and Docker images: import them as dsec layers and images, export dsec images as
runnable OCI images (what `dsec import` and `dsec export --format oci` call)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..build.ociimport import ImportedLayer, ImportProgress, ImportReport, ImportRun
from ..build.ociimport import import_image as _import
from ..build.ociimport import import_images as _import_all
from ..oci.export import ExportReport
from ..oci.export import export_oci as _export
from ..push.stores import Store, open_store

__all__ = ["ExportReport", "ImportProgress", "ImportReport", "ImportRun", "ImportedLayer",
           "export_oci", "import_image", "import_images"]


def _store(store: str | Store | None) -> Store:
    return store if isinstance(store, Store) else open_store(store)


def import_image(source: str, *, as_ref: str | None = None, store: str | Store | None = None,
                 platform: str | None = None, insecure: bool = False, replace: bool = False,
                 progress: Callable[[ImportProgress], None] | None = None) -> ImportReport:
    """Import an image from a registry (``host/repo:tag`` or ``@sha256:...``), an OCI
    layout directory or a `docker save` tarball into a store; each layer becomes
    ``oci-layer@<diff_id>``, the image ``as_ref`` (default: the repository's name and tag)."""
    return _import(_store(store), source, as_ref=as_ref, platform=platform, insecure=insecure,
                   progress=progress, replace=replace)


def import_images(sources: list[str], *, store: str | Store | None = None,
                  platform: str | None = None, insecure: bool = False, replace: bool = False,
                  progress: Callable[[ImportProgress], None] | None = None) -> ImportRun:
    """Import a library of images in one run, each under the name its source gives: each
    distinct layer is read once, layers of different images side by side, a chunk they
    share compressed once. An image that fails is listed in ``ImportRun.failed`` and leaves
    the store as it was; the others are imported all the same."""
    return _import_all(_store(store), sources, platform=platform, insecure=insecure,
                       progress=progress, replace=replace)


def export_oci(ref: str, dest: Path | None = None, *, to_registry: str | None = None,
               store: str | Store | None = None, compression: str = "gzip",
               insecure: bool = False,
               progress: Callable[[ImportProgress], None] | None = None) -> ExportReport:
    """Write an image as an OCI image layout at ``dest`` and/or push it to ``to_registry``
    (``host/repo:tag``): one tar+gzip (or zstd) layer per dsec layer, a config with its env,
    workdir, user, entrypoint and cmd."""
    return _export(_store(store), ref, dest, to_registry=to_registry,
                   compression=compression, insecure=insecure, progress=progress)
