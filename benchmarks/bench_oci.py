"""Importing a library of related OCI images, against `skopeo copy` of the same images.

    python -m benchmarks oci [--tree DIR] [--images N]

Makes N (default 10) images from a real tree (default /usr/lib/python3.11): three versions
of a base layer (the tree, then 1% of its files edited, twice) and one application layer
per image (a different slice of /usr/share, one file edited per image), gzip-compressed as
registries hold them, pushed with skopeo to Debian's docker-registry on loopback. Then:

- `skopeo copy docker://... oci:LAYOUT:TAG` of every image into one OCI layout (what a
  layer-deduplicating local copy costs), timed;
- `dsec import` of every image into a fresh file store (SDK, one run), timed.

Reported: import throughput against skopeo's on the same images (higher is better), dsec's
stored bytes against the sum of the images' compressed layers and against the
layer-deduplicated layout. Results go to benchmarks/results/oci.json.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import du, save, sh

DEFAULT_TREE = "/usr/lib/python3.11"


def _tar(root: Path, edit: int, prefix: str) -> bytes:
    """A layer tar of ``root`` under ``prefix``, every 100th file edited when ``edit``."""
    buf = io.BytesIO()
    files = sorted(p for p in root.rglob("*") if not p.is_symlink() and (p.is_file()
                                                                        or p.is_dir()))
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n, p in enumerate(files):
            ti = tarfile.TarInfo(f"{prefix}/{p.relative_to(root)}")
            st = p.stat()
            ti.mode, ti.mtime = st.st_mode & 0o7777, int(st.st_mtime)
            if p.is_dir():
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
                continue
            data = p.read_bytes()
            if edit and n % 100 == edit % 100:
                data = data[:len(data) // 2] + f"# edit {edit}\n".encode() + data[len(data) // 2:]
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _layout(path: Path, layers: list[bytes], tag: str) -> int:
    """An OCI layout of gzip layers; returns the sum of the compressed layer sizes."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> dict[str, Any]:
        d = hashlib.sha256(data).hexdigest()
        (blobs / d).write_bytes(data)
        return {"digest": f"sha256:{d}", "size": len(data)}

    descs = []
    for plain in layers:
        blob = gzip.compress(plain, compresslevel=6, mtime=0)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(blob)})
    config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin"]},
              "rootfs": {"type": "layers", "diff_ids": [
                  "sha256:" + hashlib.sha256(x).hexdigest() for x in layers]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           **put(json.dumps(config).encode())}, "layers": descs}
    m = put(json.dumps(manifest).encode())
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": manifest["mediaType"], **m,
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return sum(d["size"] for d in descs)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks oci")
    ap.add_argument("--tree", default=DEFAULT_TREE)
    ap.add_argument("--images", type=int, default=10)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-oci-", dir="/var/tmp"))
    from dsec_cli.push import testing

    reg = testing.start_registry(str(work))
    try:
        bases = [_tar(Path(args.tree), v, "usr/lib/base") for v in (0, 1, 2)]
        apps = sorted(p for p in Path("/usr/share").iterdir() if p.is_dir())
        total_compressed = 0
        for i in range(args.images):
            app = _tar(apps[i % len(apps)], i + 1, "app")
            lay = work / f"src-{i}"
            total_compressed += _layout(lay, [bases[i % 3], app], "v1")
            sh(f"skopeo --insecure-policy copy --dest-tls-verify=false oci:{lay}:v1 "
               f"docker://{reg.url}/lib/img{i}:v1")
            shutil.rmtree(lay)
        t = time.perf_counter()
        for i in range(args.images):
            sh(f"skopeo --insecure-policy copy --src-tls-verify=false "
               f"docker://{reg.url}/lib/img{i}:v1 oci:{work / 'skopeo'}:img{i}")
        skopeo_s = time.perf_counter() - t
        dedup_layout = du(work / "skopeo" / "blobs")

        os.environ["DSEC_DATA_DIR"] = str(work / "data")
        os.environ["DOCKER_CONFIG"] = str(work / "docker")
        from dsec_cli.api import oci

        store = (work / "store").as_uri()
        t = time.perf_counter()
        for i in range(args.images):
            oci.import_image(f"{reg.url}/lib/img{i}:v1", as_ref=f"img{i}@v1", store=store,
                             insecure=True)
        dsec_s = time.perf_counter() - t
        stored = sum(du(work / "store" / k) for k in ("packs", "indexes", "manifests"))
        out = {
            "images": args.images, "tree": args.tree,
            "compressed_layers_sum": total_compressed, "layer_dedup_bytes": dedup_layout,
            "dsec_stored_bytes": stored,
            "stored_vs_compressed_sum": round(stored / total_compressed, 3),
            "stored_vs_layer_dedup": round(stored / dedup_layout, 3),
            "skopeo_seconds": round(skopeo_s, 2), "dsec_seconds": round(dsec_s, 2),
            "import_throughput_vs_skopeo": round(skopeo_s / dsec_s, 3),
        }
        print(json.dumps(out, indent=2))
        save("oci", out)
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
