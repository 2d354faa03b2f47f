"""Push and pull throughput against the peers, on the same servers in the same run.

    python -m benchmarks push [--tree DIR] [--runs N]

Builds a >= 500 MB tree (default /usr/lib/x86_64-linux-gnu) into a file:// store, then, with
one moto S3 server and one docker-registry on loopback:

- S3: `dsec push`/`dsec pull` (SDK, 8 in flight) vs boto3's transfer manager (s3transfer, what
  `aws s3 cp --recursive` runs, 10 in flight) moving the same object files;
- OCI: `dsec push`/`pull` vs the oras SDK pushing and pulling one tarball of the same bytes;
- incremental: bytes `dsec push` sends for a version with 1% of its files edited.

Ratios are dsec throughput / peer throughput on the same bytes (higher is better), medians
of --runs. Results go to benchmarks/results/push.json and docs/benchmarks-push.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, du, save, sh, timed

DEFAULT_TREE = "/usr/lib/x86_64-linux-gnu"


def _objects(store: Path) -> list[Path]:
    return sorted(p for k in ("packs", "indexes", "manifests") if (store / k).exists()
                  for p in (store / k).rglob("*") if p.is_file())


def _change_one_percent(tree: Path) -> int:
    files = sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()
                   and p.stat().st_size > 0)
    for p in files[::100]:
        data = bytearray(p.read_bytes())
        data[len(data) // 2:len(data) // 2] = b"# a small edit in the middle of the file\n"
        os.chmod(p, 0o644)
        p.write_bytes(bytes(data))
    return len(files[::100])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks push")
    ap.add_argument("--tree", default=DEFAULT_TREE)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-push-", dir="/var/tmp"))
    from dsec_cli.push import testing

    os.environ.update(testing.S3_ENV)
    moto = testing.start_moto()
    reg = testing.start_registry(str(work))
    try:
        run(Path(args.tree), args.runs, work, moto.url, reg.url)
    finally:
        moto.stop()
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(src: Path, runs: int, work: Path, endpoint: str, registry: str) -> None:
    import boto3
    import oras.provider
    from s3transfer.manager import TransferConfig, TransferManager

    from dsec_cli.build.builder import build
    from dsec_cli.push import api

    os.environ["DSEC_DATA_DIR"] = str(work / "data")
    spec = work / "spec"
    spec.mkdir()
    sh(f"cp -a {src} {spec}/tree")
    (spec / "env.yaml").write_text('layer: env\nversion: "1"\nsteps:\n'
                                   "  - copy: {src: ./tree, dst: /env}\n")
    local = work / "store"
    build([spec], local.as_uri())
    objs = _objects(local)
    nbytes = sum(p.stat().st_size for p in objs)
    print(f"tree {src}: {du(spec / 'tree') / 1e6:.0f} MB; stored as {len(objs)} objects, "
          f"{nbytes / 1e6:.0f} MB; {runs} runs each")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    res: dict[str, Any] = {"tree": str(src), "tree_bytes": du(spec / "tree"),
                           "objects": len(objs), "bytes": nbytes, "runs": runs, "seconds": {}}

    def bucket() -> str:
        name = f"b{uuid.uuid4().hex[:16]}"
        s3.create_bucket(Bucket=name)
        return name

    # -- S3: dsec vs the transfer manager on the same files ----------------------------------
    state: dict[str, str] = {}

    def dsec_s3_push() -> None:
        state["url"] = f"s3://{bucket()}?endpoint_url={endpoint}"
        api.push(["env@1"], state["url"], store=local.as_uri())

    def dsec_s3_pull() -> None:
        shutil.rmtree(work / "pulled", ignore_errors=True)
        api.pull(["env@1"], state["url"], store=(work / "pulled").as_uri())

    def tm_push() -> None:
        state["bucket"] = bucket()
        with TransferManager(s3, TransferConfig(max_request_concurrency=10)) as tm:
            for p in objs:
                tm.upload(str(p), state["bucket"], str(p.relative_to(local)))

    def tm_pull() -> None:
        out = work / "tm-pulled"
        shutil.rmtree(out, ignore_errors=True)
        with TransferManager(s3, TransferConfig(max_request_concurrency=10)) as tm:
            for p in objs:
                dest = out / p.relative_to(local)
                dest.parent.mkdir(parents=True, exist_ok=True)
                tm.download(state["bucket"], str(p.relative_to(local)), str(dest))


    # -- OCI: dsec vs oras pushing one tarball of the same bytes ------------------------------
    tarball = work / "objects.tar"
    with tarfile.open(tarball, "w") as tf:
        for p in objs:
            tf.add(p, str(p.relative_to(local)))
    orc = oras.provider.Registry(hostname=registry, insecure=True)
    n = {"i": 0}

    def dsec_oci_push() -> None:
        n["i"] += 1
        state["oci"] = f"oci://{registry}/bench/dsec{n['i']}?insecure=1"
        api.push(["env@1"], state["oci"], store=local.as_uri())

    def dsec_oci_pull() -> None:
        shutil.rmtree(work / "pulled", ignore_errors=True)
        api.pull(["env@1"], state["oci"], store=(work / "pulled").as_uri())

    def oras_push() -> None:
        n["i"] += 1
        state["target"] = f"{registry}/bench/oras{n['i']}:v1"
        cwd = os.getcwd()
        os.chdir(work)  # oras pushes files by paths relative to the working directory
        try:
            orc.push(target=state["target"], files=[tarball.name], disable_path_validation=True)
        finally:
            os.chdir(cwd)

    def oras_pull() -> None:
        shutil.rmtree(work / "oras-pulled", ignore_errors=True)
        orc.pull(target=state["target"], outdir=str(work / "oras-pulled"))

    # runs are interleaved (dsec, peer, dsec, peer...) so that load from other work on the
    # machine falls on both alike
    fns = {"dsec_s3_push": dsec_s3_push, "s3transfer_push": tm_push,
           "dsec_s3_pull": dsec_s3_pull, "s3transfer_pull": tm_pull,
           "dsec_oci_push": dsec_oci_push, "oras_push": oras_push,
           "dsec_oci_pull": dsec_oci_pull, "oras_pull": oras_pull}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(timed(fn, 1)[0])
    secs = res["seconds"]
    for name, ts in times.items():
        secs[name] = statistics.median(ts)
    res["all_seconds"] = times

    # -- incremental push after a 1% change --------------------------------------------------
    changed = _change_one_percent(spec / "tree")
    (spec / "env.yaml").write_text((spec / "env.yaml").read_text().replace('"1"', '"2"'))
    build([spec], local.as_uri())
    inc = api.push(["env@2"], state["url"], store=local.as_uri())
    res["incremental"] = {"changed_files": changed, "bytes_sent": inc.bytes_sent,
                          "objects_sent": inc.objects_sent, "objects_total": inc.objects_total,
                          "fraction_of_v1": inc.bytes_sent / nbytes}

    mbs = {k: nbytes / v / 1e6 for k, v in secs.items()}
    res["mb_per_s"] = mbs
    res["ratios"] = {
        "s3_push_vs_s3transfer": mbs["dsec_s3_push"] / mbs["s3transfer_push"],
        "s3_pull_vs_s3transfer": mbs["dsec_s3_pull"] / mbs["s3transfer_pull"],
        "oci_push_vs_oras": mbs["dsec_oci_push"] / mbs["oras_push"],
        "oci_pull_vs_oras": mbs["dsec_oci_pull"] / mbs["oras_pull"],
    }
    for k, v in secs.items():
        print(f"{k:18s} {v:7.2f}s {mbs[k]:8.1f} MB/s")
    for k, v in res["ratios"].items():
        print(f"  {k}: {v:.2f}")
    print(f"1% change ({changed} files): sent {inc.bytes_sent / 1e6:.2f} MB "
          f"({inc.objects_sent}/{inc.objects_total} objects) = "
          f"{res['incremental']['fraction_of_v1']:.2%} of v1")
    out = save("push", res)
    _write_doc(res)
    print(f"results: {out}")


def _write_doc(r: dict[str, Any]) -> None:
    m, s, q = r["mb_per_s"], r["seconds"], r["ratios"]
    rows = "\n".join(f"| {k} | {s[k]:.2f} | {m[k]:.1f} |" for k in s)
    inc = r["incremental"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    doc = f"""# Push and pull benchmark

`python -m benchmarks push` (benchmarks/bench_push.py), measured {when} on the
project's 2-core machine with moto's S3 server and Debian's docker-registry on loopback,
started by the benchmark itself. Other work may share the machine, so absolute figures are
noisy; runs are interleaved (dsec, peer, dsec, peer, ...) so the ratios compare like with
like. Raw figures: benchmarks/results/push.json.

Image: `{r['tree']}` ({r['tree_bytes'] / 1e6:.0f} MB in files), built by `dsec build` into
{r['objects']} objects of {r['bytes'] / 1e6:.0f} MB. Every tool moves those same bytes:
s3transfer (the engine of `aws s3 cp --recursive`, 10 requests in flight) uploads the same
object files, the oras SDK pushes one tarball of them. Median of {r['runs']} runs.

| what | seconds | MB/s |
| --- | ---: | ---: |
{rows}

| ratio (dsec / peer throughput) | value | target |
| --- | ---: | ---: |
| S3 push vs s3transfer | {q['s3_push_vs_s3transfer']:.2f} | >= 0.8 |
| S3 pull vs s3transfer | {q['s3_pull_vs_s3transfer']:.2f} | >= 0.8 |
| OCI push vs oras push | {q['oci_push_vs_oras']:.2f} | >= 0.8 |
| OCI pull vs oras pull | {q['oci_pull_vs_oras']:.2f} | >= 0.8 |

Incremental: after editing 1% of the files ({inc['changed_files']}) and building version 2,
`dsec push` sent {inc['bytes_sent'] / 1e6:.2f} MB in {inc['objects_sent']} of
{inc['objects_total']} objects: {inc['fraction_of_v1']:.2%} of the first push.

dsec's figures include what the peers do not do: checking which objects the destination
lacks, verifying the sha256 of every object read, taking a writer lease and writing the ref.
"""
    (REPO / "docs" / "benchmarks-push.md").write_text(doc)
