"""Importing a library of related OCI images, against `skopeo copy` of the same images.

    python -m benchmarks oci [--tree DIR] [--images N] [--runs N]

Makes N (default 10) images from a real tree (default /usr/lib/python3.11; a whole Debian
base, ``debootstrap --variant=minbase --include=python3 bookworm DIR``, is a second library
to check the figures against): three versions of a base layer (the tree, then 1% of its
files edited, twice) and one application layer per image (a different slice of /usr/share, one file edited per image), gzip-compressed as
registries hold them, pushed with skopeo to Debian's docker-registry on loopback. Then, ``--runs`` times (default 3), one after the other so that both see the same load:

- `skopeo copy docker://... oci:LAYOUT:TAG` of every image, one after the other, into one
  fresh OCI layout (what a layer-deduplicating local copy costs), timed;
- `dsec import` of the whole library in one run (`import_images`, as `dsec import A B ...`)
  into a fresh file store, timed;
- `dsec import` of each image on its own (`import_image` per image, one after the other)
  into another fresh store, timed.

Each tool's output of the run before is removed before its clock starts.

Then a growing library: ten more task images (another application layer each, over the
same three bases) are imported into the library's store, and copied by skopeo into the
library's layout, both copied afresh before each timed run.

Reported: import throughput against skopeo's on the same images, for the library run and
for image-by-image imports (higher is better; each ratio is taken within each run, the
median reported, with the load average before each run), dsec's stored bytes against the sum of the images' compressed layers and against the
layer-deduplicated layout. Then an imported image (busybox under the first base and
application layers) is pushed to a dsec store served by the same registry, and a container's
first exec on a fresh node with ``--fetch lazy`` is timed against `dsec pull` of the whole
image plus an eager start from the copy. Results go to benchmarks/results/oci.json.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import resource
import shutil
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, du, save, sh

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


def _more_tasks(work: Path, reg_url: str, bases: list[bytes], apps: list[Path], n: int,
                runs: int, fresh: Callable[[str], str]) -> dict[str, Any]:
    """A library growing: ``n`` more task images (another application layer each) over the
    same three bases, imported into the store that holds the library (and copied by skopeo
    into the layout that holds it), both copied afresh before each timed run."""
    from dsec_cli.api import oci

    for i in range(n):
        lay = work / f"src-task-{i}"
        _layout(lay, [bases[i % 3], _tar(apps[i % len(apps)], 100 + i, "app")], "v1")
        sh(f"skopeo --insecure-policy copy --dest-tls-verify=false oci:{lay}:v1 "
           f"docker://{reg_url}/lib/task{i}:v1")
        shutil.rmtree(lay)
    skopeo_s, dsec_s, ratios = [], [], []
    for _ in range(runs):
        shutil.rmtree(work / "skopeo-more", ignore_errors=True)
        shutil.copytree(work / "skopeo", work / "skopeo-more")
        t = time.perf_counter()
        for i in range(n):
            sh(f"skopeo --insecure-policy copy --src-tls-verify=false "
               f"docker://{reg_url}/lib/task{i}:v1 oci:{work / 'skopeo-more'}:task{i}")
        skopeo_s.append(time.perf_counter() - t)
        store = fresh("store-more")  # the library's store and chunk tables, as they were
        shutil.copytree(work / "store", work / "store-more")
        shutil.copytree(work / "data-library", work / "data")
        t = time.perf_counter()
        run = oci.import_images([f"{reg_url}/lib/task{i}:v1" for i in range(n)], store=store,
                                insecure=True)
        dsec_s.append(time.perf_counter() - t)
        assert not run.failed, run.failed
        assert all(x.reused for r in run.reports for x in r.layers[:1])  # the bases held
        ratios.append(skopeo_s[-1] / dsec_s[-1])
        print(f"more tasks: skopeo {skopeo_s[-1]:.2f} s, dsec {dsec_s[-1]:.2f} s, "
              f"throughput ratio {ratios[-1]:.3f}", flush=True)
    return {"images": n, "skopeo_seconds": [round(x, 3) for x in skopeo_s],
            "dsec_seconds": [round(x, 3) for x in dsec_s],
            "throughput_vs_skopeo": round(statistics.median(ratios), 3)}


def _start(store_url: str, state: Path, ref: str, fetch: str) -> float:
    """A container's create and first exec on a fresh node (empty layer cache)."""
    from dsec_cli.run.node import Node
    from dsec_cli.run.options import CreateOptions

    shutil.rmtree(state, ignore_errors=True)
    node = Node(state, store_url)
    t = time.perf_counter()
    rec = node.create(ref, CreateOptions(backend="container", fetch=fetch))
    assert node.exec(rec.id, ["/bin/true"]).exit_code == 0
    took = time.perf_counter() - t
    node.remove(rec.id)
    return took


def _first_exec(work: Path, reg_url: str, layers: list[bytes], runs: int) -> dict[str, Any]:
    """An imported image (busybox under a base and an application layer) pushed to a store
    served by the loopback registry; then, on fresh nodes, a container's first exec with
    lazy fetch against `dsec pull` of the whole image plus an eager start from the copy."""
    from dsec_cli.api import oci
    from dsec_cli.push import api

    sh(f"bash {REPO / 'layerspecs/busybox/make-rootfs.sh'}")
    busybox = (REPO / "layerspecs/busybox/busybox-rootfs.tar").read_bytes()
    lay = work / "src-run"
    _layout(lay, [busybox, *layers], "v1")
    sh(f"skopeo --insecure-policy copy --dest-tls-verify=false oci:{lay}:v1 "
       f"docker://{reg_url}/lib/run:v1")
    local = (work / "run-store").as_uri()
    oci.import_image(f"{reg_url}/lib/run:v1", as_ref="run@v1", store=local, insecure=True)
    remote = f"oci://{reg_url}/dsec/run?insecure=1"
    api.push(["run@v1"], remote, store=local)
    lazy, whole = [], []
    for _ in range(runs):
        lazy.append(_start(remote, work / "node", "run@v1", "lazy"))
        pulled = work / "pulled"
        shutil.rmtree(pulled, ignore_errors=True)
        t = time.perf_counter()
        api.pull(["run@v1"], remote, store=pulled.as_uri())
        whole.append(time.perf_counter() - t
                     + _start(pulled.as_uri(), work / "node", "run@v1", "eager"))
    lz, wh = statistics.median(lazy), statistics.median(whole)
    return {"image_bytes": sum(len(x) for x in [busybox, *layers]),
            "lazy_first_exec_s": [round(x, 2) for x in lazy],
            "pull_then_eager_first_exec_s": [round(x, 2) for x in whole],
            "lazy_vs_pull_then_eager": round(lz / wh, 3)}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks oci")
    ap.add_argument("--tree", default=DEFAULT_TREE)
    ap.add_argument("--images", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-oci-", dir="/var/tmp"))
    from dsec_cli.push import testing

    reg = testing.start_registry(str(work))
    try:
        bases = [_tar(Path(args.tree), v, "usr/lib/base") for v in (0, 1, 2)]
        apps = sorted(p for p in Path("/usr/share").iterdir() if p.is_dir())
        total_compressed = 0
        first_app = b""
        for i in range(args.images):
            app = _tar(apps[i % len(apps)], i + 1, "app")
            first_app = first_app or app
            lay = work / f"src-{i}"
            total_compressed += _layout(lay, [bases[i % 3], app], "v1")
            sh(f"skopeo --insecure-policy copy --dest-tls-verify=false oci:{lay}:v1 "
               f"docker://{reg.url}/lib/img{i}:v1")
            shutil.rmtree(lay)

        os.environ["DOCKER_CONFIG"] = str(work / "docker")
        from dsec_cli.api import oci

        # each tool's output of the run before is removed before its clock starts: what is
        # timed is the copy or the import alone
        def skopeo_all() -> None:
            for i in range(args.images):
                sh(f"skopeo --insecure-policy copy --src-tls-verify=false "
                   f"docker://{reg.url}/lib/img{i}:v1 oci:{work / 'skopeo'}:img{i}")

        def fresh(store: str) -> str:
            for d in (store, "data"):
                shutil.rmtree(work / d, ignore_errors=True)
            os.environ["DSEC_DATA_DIR"] = str(work / "data")
            return (work / store).as_uri()

        def dsec_all(store: str) -> None:
            run = oci.import_images([f"{reg.url}/lib/img{i}:v1" for i in range(args.images)],
                                    store=store, insecure=True)
            assert not run.failed, run.failed

        def dsec_each(store: str) -> None:
            for i in range(args.images):
                oci.import_image(f"{reg.url}/lib/img{i}:v1", as_ref=f"img{i}@v1",
                                 store=store, insecure=True)

        def children_cpu() -> float:
            r = resource.getrusage(resource.RUSAGE_CHILDREN)
            return r.ru_utime + r.ru_stime

        # alternating, so that both see the same load; the ratio is taken within each run.
        # CPU seconds too (skopeo's processes, this process for dsec; the registry's own
        # work counts for neither): what a busy machine's share of the cores multiplies
        skopeo_s, dsec_s, ratios, loads, skopeo_cpu, dsec_cpu = [], [], [], [], [], []
        each_s: list[float] = []
        each_ratios: list[float] = []
        for run in range(args.runs):
            loads.append(round(os.getloadavg()[0], 2))
            shutil.rmtree(work / "skopeo", ignore_errors=True)
            t, c = time.perf_counter(), children_cpu()
            skopeo_all()
            skopeo_s.append(time.perf_counter() - t)
            skopeo_cpu.append(children_cpu() - c)
            store = fresh("store")
            t, c = time.perf_counter(), time.process_time()
            dsec_all(store)
            dsec_s.append(time.perf_counter() - t)
            dsec_cpu.append(time.process_time() - c)
            shutil.rmtree(work / "data-library", ignore_errors=True)
            shutil.copytree(work / "data", work / "data-library")  # its chunk tables
            ratios.append(skopeo_s[-1] / dsec_s[-1])
            store = fresh("store-each")
            t = time.perf_counter()
            dsec_each(store)
            each_s.append(time.perf_counter() - t)
            each_ratios.append(skopeo_s[-1] / each_s[-1])
            print(f"run {run + 1}: load {loads[-1]}, skopeo {skopeo_s[-1]:.2f} s "
                  f"({skopeo_cpu[-1]:.2f} s CPU), dsec one run {dsec_s[-1]:.2f} s "
                  f"({dsec_cpu[-1]:.2f} s CPU), throughput ratio {ratios[-1]:.3f}; "
                  f"image by image {each_s[-1]:.2f} s, ratio {each_ratios[-1]:.3f}",
                  flush=True)
        dedup_layout = du(work / "skopeo" / "blobs")
        stored = sum(du(work / "store" / k) for k in ("packs", "indexes", "manifests"))
        more = _more_tasks(work, reg.url, bases, apps[args.images:], args.images, args.runs,
                           fresh)
        start = _first_exec(work, reg.url, [bases[0], first_app], args.runs)
        out = {
            "images": args.images, "tree": args.tree, "runs": args.runs,
            "load_average_per_run": loads,
            "compressed_layers_sum": total_compressed, "layer_dedup_bytes": dedup_layout,
            "dsec_stored_bytes": stored,
            "stored_vs_compressed_sum": round(stored / total_compressed, 3),
            "stored_vs_layer_dedup": round(stored / dedup_layout, 3),
            "skopeo_seconds": [round(x, 2) for x in skopeo_s],
            "dsec_seconds": [round(x, 2) for x in dsec_s],
            "import_throughput_vs_skopeo_per_run": [round(x, 3) for x in ratios],
            "import_throughput_vs_skopeo": round(statistics.median(ratios), 3),
            "skopeo_cpu_seconds": [round(x, 2) for x in skopeo_cpu],
            "dsec_cpu_seconds": [round(x, 2) for x in dsec_cpu],
            # what bounds the ratio on few cores: dsec inflates, hashes and recompresses
            # what skopeo hashes and copies
            "cpus": os.cpu_count(),
            "dsec_cpu_vs_skopeo_cpu": round(statistics.median(
                d / s for d, s in zip(dsec_cpu, skopeo_cpu, strict=True)), 2),
            "dsec_image_by_image_seconds": [round(x, 2) for x in each_s],
            "image_by_image_throughput_vs_skopeo_per_run": [round(x, 3) for x in each_ratios],
            "image_by_image_throughput_vs_skopeo": round(statistics.median(each_ratios), 3),
            "image_by_image_stored_bytes": sum(du(work / "store-each" / k)
                                               for k in ("packs", "indexes", "manifests")),
            "more_tasks": more,
            "first_exec": start,
        }
        print(json.dumps(out, indent=2))
        save("oci", out)
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
