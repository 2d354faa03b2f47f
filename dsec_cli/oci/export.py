"""dsec images out as runnable OCI images: an OCI image layout directory, or pushed to a
registry.

Each dsec layer becomes one tar stream (path order, PAX headers carrying exact mtimes and
xattrs, whiteouts as ``.wh.NAME`` files and opaque directories as ``.wh..wh..opq``),
compressed with gzip (or zstd) as it is written and hashed on both sides, so the
uncompressed digest (``diff_id``) and the blob digest come out of one pass. The image config
carries the image's env and workdir and, for an imported image, its user, entrypoint, cmd
and labels. Output is deterministic: the same image exports to the same digests, and
importing an export gives back the same dsec content digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..format.index import Entry
from ..format.reader import ChunkReader
from ..format.tree import parent_of
from ..push.materialize import (
    _add_tar_member,
    _reader_for,
    check_export_dir,
    dir_into_place,
    resolve_image,
)
from ..push.stores.base import Store
from .sources import parse_image_ref

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = {"gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
               "zstd": "application/vnd.oci.image.layer.v1.tar+zstd"}


@dataclass
class ExportedLayer:
    ref: str
    manifest: str
    diff_id: str
    digest: str
    size: int


@dataclass
class ExportReport:
    ref: str
    digest: str  # the dsec image manifest
    manifest_digest: str  # the OCI manifest
    dest: str = ""
    registry: str = ""
    layers: list[ExportedLayer] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _BlobWriter:
    """A file-like sink: hashes what the tar writer gives it, compresses, hashes again and
    writes to ``path``."""

    def __init__(self, path: Path, compression: str, tick: Callable[[int], None] | None
                 ) -> None:
        self.f = open(path, "wb")
        self.plain = hashlib.sha256()
        self.packed = hashlib.sha256()
        self.size = 0
        self.tick = tick
        if compression == "zstd":
            import zstandard  # only for zstd layers: gzip is the default

            self.c: Any = zstandard.ZstdCompressor(level=3).compressobj()
        else:
            self.c = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip framing, mtime 0

    def _out(self, data: bytes) -> None:
        if data:
            self.packed.update(data)
            self.f.write(data)
            self.size += len(data)
            if self.tick:
                self.tick(len(data))

    def write(self, data: bytes) -> int:
        self.plain.update(data)
        self._out(self.c.compress(bytes(data)))
        return len(data)

    def close(self) -> tuple[str, str, int]:
        self._out(self.c.flush())
        self.f.close()
        return "sha256:" + self.plain.hexdigest(), "sha256:" + self.packed.hexdigest(), self.size


def _write_layer_tar(entries: list[Entry], reader: ChunkReader, sink: _BlobWriter) -> None:
    kinds: dict[str, str] = {}
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tf:  # type: ignore[call-overload]
        for e in entries:
            if e.type == "whiteout":
                parent = parent_of(e.path)
                name = f"{'' if parent == '.' else parent + '/'}.wh.{e.path.rsplit('/', 1)[-1]}"
                ti = tarfile.TarInfo(f"./{name}")
                ti.mode = 0o644
                tf.addfile(ti)
                continue
            _add_tar_member(tf, e, reader, kinds)
            if e.type == "dir" and e.opaque:
                prefix = "." if e.path == "." else f"./{e.path}"
                ti = tarfile.TarInfo(f"{prefix}/.wh..wh..opq")
                ti.mode = 0o644
                tf.addfile(ti)


def _put_blob(blobs: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _config(img: Any, diff_ids: list[str]) -> dict[str, Any]:
    ann = img.manifest.annotations
    c: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in img.env.items()],
                         "WorkingDir": img.workdir or "/"}
    if ann.get("oci.user"):
        c["User"] = ann["oci.user"]
    for key, name in (("Entrypoint", "oci.entrypoint"), ("Cmd", "oci.cmd")):
        if name in ann:
            try:
                value = json.loads(ann[name])
            except ValueError:
                continue
            if isinstance(value, list) and all(isinstance(x, str) for x in value):
                c[key] = value
    labels = {k[len("oci.label."):]: v for k, v in ann.items() if k.startswith("oci.label.")}
    if labels:
        c["Labels"] = labels
    if ann.get("oci.stop_signal"):
        c["StopSignal"] = ann["oci.stop_signal"]
    arch = ann.get("oci.architecture", "amd64")
    return {"created": "1970-01-01T00:00:00Z", "architecture": arch, "os": "linux",
            "config": c, "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "1970-01-01T00:00:00Z",
                         "created_by": f"dsec layer {m.ref}"} for _, m in img.layers]}


def write_layout(store: Store, ref: str, dest: Path, *, compression: str = "gzip",
                 tag: str = "", tick: Callable[[int], None] | None = None,
                 on_layer: Callable[[], None] | None = None) -> ExportReport:
    """The image as an OCI image layout at ``dest`` (a new or empty directory), written
    beside it and renamed into place."""
    if compression not in LAYER_TYPES:
        raise UsageError(f"unknown layer compression {compression!r}: choose gzip or zstd")
    check_export_dir(dest)
    img = resolve_image(store, ref)
    report = ExportReport(ref, img.digest, "", str(dest))
    with dir_into_place(dest) as tmp:
        blobs = tmp / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        descs: list[dict[str, Any]] = []
        diff_ids: list[str] = []
        for d, m in img.layers:
            index, reader = _reader_for(store, d, m)
            part = blobs / f".layer-{len(descs)}"
            sink = _BlobWriter(part, compression, tick)
            try:
                _write_layer_tar(index.entries, reader, sink)
            finally:
                diff_id, digest, size = sink.close()
            os.replace(part, blobs / digest.removeprefix("sha256:"))
            descs.append({"mediaType": LAYER_TYPES[compression], "digest": digest,
                          "size": size})
            diff_ids.append(diff_id)
            report.layers.append(ExportedLayer(m.ref, d, diff_id, digest, size))
            report.bytes_written += size
            if on_layer:
                on_layer()
        config = _put_blob(blobs, json.dumps(_config(img, diff_ids), sort_keys=True,
                                             separators=(",", ":")).encode())
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, **config}, "layers": descs,
                    "annotations": {"dev.dsec.image": ref, "dev.dsec.digest": img.digest}}
        mdesc = _put_blob(blobs, json.dumps(manifest, sort_keys=True,
                                            separators=(",", ":")).encode())
        report.manifest_digest = mdesc["digest"]
        entry: dict[str, Any] = {"mediaType": OCI_MANIFEST, **mdesc}
        if tag:
            entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
        (tmp / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        (tmp / "index.json").write_text(json.dumps(
            {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry]}))
    return report


def push_layout(layout: Path, report: ExportReport, target: str, insecure: bool) -> None:
    """Upload a layout written by `write_layout` to ``host/repo:tag``: blobs the registry
    lacks, then the manifest under the tag."""
    from .store import OCIStore  # oras, the optional extra: loaded only to push

    ref = parse_image_ref(target)
    if ref.digest:
        raise UsageError(f"{target}: push to a tag, not a digest")
    http = OCIStore(f"oci://{ref.host}/{ref.repo}", ref.host, ref.repo, insecure)
    try:
        blobs = layout / "blobs" / "sha256"
        mdigest = report.manifest_digest.removeprefix("sha256:")
        for p in sorted(blobs.iterdir()):
            if p.name == mdigest:
                continue
            what = f"pushing blob sha256:{p.name[:12]} to {ref}"
            if http._head_blob(p.name, what) is None:
                with open(p, "rb") as f:
                    http._upload(p.name, f, p.stat().st_size, what)
        body = (blobs / mdigest).read_bytes()
        http._request("PUT", f"{http.base}/manifests/{ref.tag or 'latest'}",
                      f"pushing the manifest of {ref}", ok=(201,), data=body,
                      headers={"Content-Type": OCI_MANIFEST})
        report.registry = str(ref)
    finally:
        http.close()


def export_oci(store: Store, ref: str, dest: Path | None, *, to_registry: str | None = None,
               compression: str = "gzip", insecure: bool = False,
               progress: Callable[[Any], None] | None = None) -> ExportReport:
    """`write_layout` to ``dest`` and/or `push_layout` to ``to_registry``."""
    if dest is None and not to_registry:
        raise UsageError("export --format oci needs a destination directory or --to-registry")
    t0 = time.monotonic()
    img = resolve_image(store, ref)
    prog = _Progress(0, len(img.layers), 0, 0)  # the compressed size is known at the end

    def tick(n: int) -> None:
        prog.bytes_done += n
        if progress:
            progress(prog)

    def on_layer() -> None:
        prog.objects_done += 1
        if progress:
            progress(prog)

    tag = ref.partition("@")[2] if "@" in ref else ""
    if to_registry:
        tag = to_registry.rsplit(":", 1)[-1] if ":" in to_registry.rsplit("/", 1)[-1] else tag
    work = None
    if dest is None:
        work = Path(tempfile.mkdtemp(prefix="export-", dir=store.staging_dir()))
        dest = work / "layout"
    try:
        report = write_layout(store, ref, dest, compression=compression, tag=tag, tick=tick,
                              on_layer=on_layer)
        if to_registry:
            push_layout(dest, report, to_registry, insecure)
        if work is not None:
            report.dest = ""
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    report.seconds = time.monotonic() - t0
    return report


@dataclass
class _Progress:
    objects_done: int
    objects_total: int
    bytes_done: int
    bytes_total: int
