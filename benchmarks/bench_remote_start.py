"""Starting a sandbox from a remote store: eager start straight from S3 (moto on loopback) and
from OCI (docker-registry on loopback) against `dsec pull` into a local store plus an eager
start from it, on two trees of the same bytes — one of many small files, one of a few large
ones — so that the cost is seen to follow bytes, not files. Each start is on a fresh node
(empty layer cache); the fncall backend keeps the sandbox itself cheap. Also a container's
first exec with eager and with lazy fetch (what `--fetch auto` weighs).

    python -m benchmarks remote_start [--mb 48] [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .common import REPO, save


def _tree(root: Path, total: int, files: int) -> None:
    per = total // files
    for i in range(files):
        d = root / f"d{i // 500}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(os.urandom(per))


def _start(store_url: str, state: Path, ref: str, fetch: str = "eager",
           backend: str = "fncall") -> float:
    from dsec_cli.run.node import Node
    from dsec_cli.run.options import CreateOptions

    shutil.rmtree(state, ignore_errors=True)
    node = Node(state, store_url)
    t = time.perf_counter()
    rec = node.create(ref, CreateOptions(backend=backend, fetch=fetch))
    if backend == "container":
        assert node.exec(rec.id, ["true"]).exit_code == 0
    took = time.perf_counter() - t
    node.remove(rec.id)
    return took


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks remote_start")
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    from dsec_cli.build.builder import build
    from dsec_cli.build.image import write_image
    from dsec_cli.format.refs import resolve
    from dsec_cli.push import api, testing
    from dsec_cli.push.stores import open_store

    work = Path(tempfile.mkdtemp(prefix="dsec-bench-remote-", dir="/var/tmp"))
    os.environ.update(testing.S3_ENV)
    os.environ["DSEC_DATA_DIR"] = str(work / "data")
    moto = testing.start_moto()
    reg = None
    res: dict[str, Any] = {"mb": args.mb, "runs": args.runs, "trees": {}}
    try:
        reg = testing.start_registry(str(work))
        import boto3

        s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
        for name, files in (("many-small", args.mb * 256), ("few-large", 6)):
            spec = work / name
            _tree(spec / "tree", args.mb << 20, files)
            (spec / "env.yaml").write_text(f'layer: {name}\nversion: "1"\nsteps:\n'
                                           "  - copy: {src: ./tree, dst: /t}\n")
            local = (work / "store").as_uri()
            if not (work / "store" / "refs" / "busybox").exists():
                subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")],
                               check=True)
                build([REPO / "layerspecs/busybox/busybox.yaml"], local)
            build([spec], local)
            with open_store(local) as st:  # busybox below the tree: a container can exec
                write_image(st, f"{name}-img", "1", [resolve(st, "busybox@1.35-1"),
                                                     resolve(st, f"{name}@1")],
                            env={"PATH": "/bin"}, commit=True)
            ref = f"{name}-img@1"
            bucket = f"b{uuid.uuid4().hex[:12]}"
            s3.create_bucket(Bucket=bucket)
            remotes = {"s3": f"s3://{bucket}?endpoint_url={moto.url}",
                       "oci": f"oci://{reg.url.removeprefix('http://')}/bench/{name}"
                              "?insecure=1"}
            row: dict[str, Any] = {"files": files}
            for kind, url in remotes.items():
                api.push([ref], url, store=local)
                eager, pulled = [], []
                for _ in range(args.runs):
                    eager.append(_start(url, work / "node", ref))
                    pulled_store = work / "pulled"
                    shutil.rmtree(pulled_store, ignore_errors=True)
                    t = time.perf_counter()
                    api.pull([ref], url, store=pulled_store.as_uri())
                    pull_s = time.perf_counter() - t
                    pulled.append(pull_s + _start(pulled_store.as_uri(), work / "node", ref))
                e, p = min(eager), min(pulled)
                # what --fetch auto weighs: a container's first exec, eager vs lazy
                ce = _start(url, work / "node", ref, "eager", "container")
                cl = _start(url, work / "node", ref, "lazy", "container")
                row[kind] = {"eager_start_s": e, "pull_plus_local_start_s": p, "ratio": e / p,
                             "container_first_exec_eager_s": ce,
                             "container_first_exec_lazy_s": cl}
                print(f"{name:10} ({files:5} files, {args.mb} MB) {kind:3}: eager start "
                      f"{e:.2f} s, pull + local start {p:.2f} s -> {e / p:.2f}x; container "
                      f"first exec eager {ce:.2f} s, lazy {cl:.2f} s", flush=True)
            res["trees"][name] = row
        print(f"saved {save('remote_start', res)}")
    finally:
        moto.stop()
        if reg is not None:
            reg.stop()
        shutil.rmtree(work, ignore_errors=True)
