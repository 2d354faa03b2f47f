"""Lazy start benchmark: eager vs lazy vs lazy+prefetch vs background, side by side.

The image (>= 1 GB): busybox, the shared libraries a Python needs, and a copy of a large
Python environment (default /root/.pyenv/versions/3.11.7, ~1 GB, ~50k files). It is built
into a file:// store and pushed to an S3 store (moto on loopback). For each store and fetch
mode a fresh node (empty chunk and layer caches, page cache dropped) creates a container
sandbox and runs:

- first exec: `true` as soon as the sandbox exists; bytes fetched by then;
- subset: a Python importing a few packages (json, sqlite3, email, http.client, yaml, click,
  boto3);
- everything: every file of the image read once (`find ... -exec cat`).

lazy+prefetch runs the image version `dsec optimize` wrote after profiling the same workload.
Also: cached read throughput (a lazy mount over a warm chunk cache vs the same files in an
eager sandbox, page cache dropped before each).

    .venv/bin/python -m benchmarks lazy [--python DIR] [--stores file,s3] [--quick]

Results: benchmarks/results/lazy.json, quoted in docs/benchmarks-lazy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from .common import REPO, RESULTS, drop_caches, save

WORK = Path(os.environ.get("DSEC_BENCH_DIR", "/tmp/dsec-bench-lazy"))
SUBSET = ("import json, decimal, sqlite3, email.parser, http.client, yaml, click, boto3; "
          "boto3.session.Session")


def _libs_for(pyroot: Path) -> set[str]:
    """Shared libraries (host paths) the interpreter and its extension modules load."""
    out: set[str] = set()
    files = [pyroot / "bin/python3"] + list(pyroot.rglob("*.so"))
    for i in range(0, len(files), 200):
        p = subprocess.run(["ldd", *map(str, files[i:i + 200])], capture_output=True,
                           text=True)
        for line in p.stdout.splitlines():
            parts = line.split()
            for tok in parts:
                if tok.startswith("/") and not tok.startswith(str(pyroot)) and ":" not in tok:
                    out.add(tok)
    return out


def stage_env(pyroot: Path, env: Path) -> Path:
    if not (env / pyroot.relative_to("/")).is_dir():
        shutil.rmtree(env, ignore_errors=True)
        dest = env / pyroot.relative_to("/")
        dest.parent.mkdir(parents=True)
        subprocess.run(["cp", "-a", str(pyroot), str(dest)], check=True)
    return env


def stage(pyroot: Path) -> tuple[Path, Path]:
    libs, env = WORK / "stage-libs", stage_env(pyroot, WORK / "stage-py")
    if not libs.is_dir():
        tmp = WORK / "stage-libs.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for lib in sorted(_libs_for(pyroot)):
            for p in {lib, os.path.realpath(lib)}:
                d = tmp / p.lstrip("/")
                d.parent.mkdir(parents=True, exist_ok=True)
                if not d.exists():
                    shutil.copy2(os.path.realpath(p), d)
        os.rename(tmp, libs)
    return libs, env


def build_image(url: str, pyroot: Path, extra: Path | None) -> None:
    from dsec_cli.build.builder import build
    from dsec_cli.build.image import write_image
    from dsec_cli.build.layer import build_layer_from_dir
    from dsec_cli.format.refs import resolve
    from dsec_cli.push.stores import open_store

    libs, env = stage(pyroot)
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    build([REPO / "layerspecs/busybox/busybox.yaml"], url)
    with open_store(url) as st:
        lib_d, _ = build_layer_from_dir(st, libs, "pylibs", "1", created_by="bench")
        py_d, _ = build_layer_from_dir(st, env, "pyenv", "1", created_by="bench")
        layers = [resolve(st, "busybox@1.35-1"), lib_d, py_d]
        if extra is not None:  # a second toolchain, as multi-Python images carry
            ex_d, _ = build_layer_from_dir(st, stage_env(extra, WORK / "stage-extra"),
                                           "pyextra", "1", created_by="bench")
            layers.append(ex_d)
        write_image(st, "pybench", "1", layers,
                    env={"PATH": f"{pyroot}/bin:/bin:/usr/bin"}, commit=True)


def image_bytes(url: str, ref: str) -> tuple[int, int]:
    from dsec_cli.push.materialize import resolve_image
    from dsec_cli.push.stores import open_store

    with open_store(url) as st:
        img = resolve_image(st, ref)
        return (sum(m.stored_size for _, m in img.layers), sum(m.size for _, m in img.layers))


TRASH: list[Path] = []  # node dirs removed at the end: unlinking a GB of files is slow here


def _stats(node: Any, sid: str) -> dict[str, Any] | None:
    time.sleep(0.3)  # the daemon writes its statistics ten times a second (not timed)
    stats: dict[str, Any] | None = node.fetch_stats(node.lookup(sid))
    return stats


def run_once(url: str, ref: str, fetch: str, cmd: list[str]) -> dict[str, Any]:
    """A fresh node: create, exec `true` (first exec), then the workload. Times are from the
    start of create; the pause that reads the statistics at first exec is not counted."""
    from dsec_cli.run.node import CreateOptions, Node

    state = WORK / f"node-{fetch}-{time.monotonic_ns()}"
    TRASH.append(state)
    node = Node(state, url)
    drop_caches()
    t0 = time.perf_counter()
    rec = node.create(ref, CreateOptions(backend="container", fetch=fetch))
    try:
        r = node.exec(rec.id, ["true"])
        assert r.exit_code == 0, r
        first = time.perf_counter() - t0
        stats = _stats(node, rec.id)
        out: dict[str, Any] = {"first_exec_s": round(first, 3),
                               "fetched_at_first_exec": stats["bytes_fetched"] if stats else None}
        t1 = time.perf_counter()
        r = node.exec(rec.id, cmd)
        assert r.exit_code == 0, (r.stdout[-500:], r.stderr[-500:])
        out["complete_s"] = round(first + time.perf_counter() - t1, 3)
        stats = _stats(node, rec.id)
        out["fetched"] = stats["bytes_fetched"] if stats else None
        out["requests"] = stats["requests"] if stats else None
        out["stall_s"] = stats["stall_seconds"] if stats else None
        return out
    finally:
        node.remove(rec.id)


def optimized(url: str, name: str, cmd: list[str]) -> str:
    from dsec_cli.push.stores import open_store
    from dsec_cli.run.lazy.optimize import optimize
    from dsec_cli.run.node import CreateOptions, Node

    state = WORK / f"node-profile-{name}-{time.monotonic_ns()}"
    node = Node(state, url)
    rec = node.create("pybench@1", CreateOptions(fetch="lazy", record_seconds=float("inf")))
    try:
        assert node.exec(rec.id, cmd).exit_code == 0
    finally:
        node.remove(rec.id)
    with open_store(url) as st:
        res = optimize(st, "pybench@1", state, f"pybench@1-{name}")
    TRASH.append(state)
    return res.image


def cached_throughput(url: str, files: list[str]) -> dict[str, Any]:
    """Reading the same files: lazy mount over a warm chunk cache vs an eager sandbox."""
    from dsec_cli.run.node import CreateOptions, Node

    out: dict[str, Any] = {}
    state = WORK / f"node-throughput-{time.monotonic_ns()}"
    node = Node(state, url)
    cmd = ["sh", "-c", "cat " + " ".join(files) + " >/dev/null"]
    for fetch in ("eager", "lazy", "lazy"):  # the first lazy run fills the chunk cache
        rec = node.create("pybench@1", CreateOptions(fetch=fetch))
        try:
            drop_caches()
            t = time.perf_counter()
            assert node.exec(rec.id, cmd).exit_code == 0
            out[fetch] = time.perf_counter() - t
            if fetch == "lazy":
                t = time.perf_counter()  # again: the kernel page cache of the mount
                assert node.exec(rec.id, cmd).exit_code == 0
                out["lazy_page_cache"] = time.perf_counter() - t
                rec2 = rec
        finally:
            node.remove(rec.id)
    del rec2
    TRASH.append(state)
    return out


def servers(tree: Path) -> dict[str, Any]:
    """Kernel passthrough vs the libfuse daemon vs eager on one small image (busybox + ``tree``
    in a file:// store), in one run: first exec (time, bytes fetched by then), reading every
    file, and reading every file again from a warm chunk cache against an eager sandbox's
    local disk (page cache dropped before each)."""
    from dsec_cli.build.builder import build
    from dsec_cli.build.image import write_image
    from dsec_cli.build.layer import build_layer_from_dir
    from dsec_cli.format.refs import resolve
    from dsec_cli.push.stores import open_store
    from dsec_cli.run.node import CreateOptions, Node

    url = (WORK / "servers-store").as_uri()
    if not (WORK / "servers-store" / "refs" / "srvbench").exists():
        subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
        build([REPO / "layerspecs/busybox/busybox.yaml"], url)
        with open_store(url) as st:
            d, _ = build_layer_from_dir(st, tree, "srvdata", "1", created_by="bench")
            write_image(st, "srvbench", "1", [resolve(st, "busybox@1.35-1"), d],
                        env={"PATH": "/bin"}, commit=True)
    stored, _ = image_bytes(url, "srvbench@1")
    everything = ["sh", "-c", "find / -xdev -type f -exec cat {} + >/dev/null"]
    out: dict[str, Any] = {"tree": str(tree), "image_stored_bytes": stored}
    for name, fetch, server in (("eager", "eager", ""), ("kernel", "lazy", "kernel"),
                                ("daemon", "lazy", "daemon")):
        os.environ["DSEC_LAZY_SERVER"] = server or "kernel"
        out[name] = run_once(url, "srvbench@1", fetch, everything)
        print(name, json.dumps(out[name]), flush=True)
    # warm reads: one node whose caches a first lazy sandbox of each server filled; the 40
    # largest files (as the cached-read figure above) and every file
    largest = sorted((p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()),
                     key=lambda p: -p.stat().st_size)[:40]
    big = ["sh", "-c", "cat " + " ".join(shlex.quote("/" + str(p.relative_to(tree)))
                                         for p in largest) + " >/dev/null"]
    state = WORK / f"node-warm-{time.monotonic_ns()}"
    TRASH.append(state)
    node = Node(state, url)
    for name, fetch, server in (("eager", "eager", ""), ("fill", "lazy", "daemon"),
                                ("daemon", "lazy", "daemon"), ("fill", "lazy", "kernel"),
                                ("kernel", "lazy", "kernel")):
        os.environ["DSEC_LAZY_SERVER"] = server or "kernel"
        rec = node.create("srvbench@1", CreateOptions(backend="container", fetch=fetch))
        try:
            for what, cmd in (("warm_read_s", everything), ("warm_read_largest_s", big)):
                drop_caches()
                t = time.perf_counter()
                assert node.exec(rec.id, cmd).exit_code == 0
                out.setdefault(what, {})[name] = round(time.perf_counter() - t, 3)
        finally:
            node.remove(rec.id)
    os.environ.pop("DSEC_LAZY_SERVER", None)
    w, wl, e = out["warm_read_s"], out["warm_read_largest_s"], out["eager"]
    out["ratios"] = {
        s: {"read_everything_vs_eager": round(out[s]["complete_s"] / e["complete_s"], 2),
            "warm_read_every_file_vs_local_disk": round(w["eager"] / w[s], 2),
            "warm_read_40_largest_vs_local_disk": round(wl["eager"] / wl[s], 2),
            "bytes_to_first_exec_pct": round(100 * (out[s]["fetched_at_first_exec"] or 0)
                                             / stored, 1),
            "first_exec_vs_eager": round(out[s]["first_exec_s"] / e["first_exec_s"], 2)}
        for s in ("kernel", "daemon")}
    return out


def report(results: dict[str, Any]) -> str:
    """Markdown tables of a results file (docs/benchmarks-lazy.md quotes them)."""
    mb = 1e6
    lines = []
    for kind, r in results["stores"].items():
        stored = r["image_stored_bytes"]
        lines += [f"### {kind} store: image {r['image_bytes'] / mb:.0f} MB "
                  f"({stored / mb:.0f} MB stored)", "",
                  "| workload | mode | first exec | fetched by first exec | complete | "
                  "vs eager | fetched in all | requests | stall |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for w in [w for w in ("subset", "everything") if w in r]:
            eager = r[w]["eager"]["complete_s"]
            for mode, row in r[w].items():
                f1 = row["fetched_at_first_exec"]
                first_b = (f"{stored / mb:.0f} MB (100%)" if mode == "eager" else
                           f"{f1 / mb:.1f} MB ({100 * f1 / stored:.1f}%)")
                fa = row["fetched"]
                all_b = f"{stored / mb:.0f} MB" if mode == "eager" else f"{fa / mb:.0f} MB"
                lines.append(
                    f"| {w} | {mode} | {row['first_exec_s']:.2f} s | {first_b} | "
                    f"{row['complete_s']:.2f} s | {row['complete_s'] / eager:.2f}x | {all_b} | "
                    f"{row['requests'] if row['requests'] is not None else '-'} | "
                    f"{row['stall_s'] if row['stall_s'] is not None else '-'} |")
        lines.append("")
    c = results.get("cached_read")
    if c:
        lines += ["| cached read of the 40 largest .so files | time | vs eager sandbox |",
                  "| --- | --- | --- |",
                  f"| eager sandbox (local disk, page cache dropped) | {c['eager']:.3f} s | 1.00x |",
                  f"| lazy, warm chunk cache (page cache dropped) | {c['lazy']:.3f} s | "
                  f"{c['eager'] / c['lazy']:.2f}x throughput |",
                  f"| lazy, read again (kernel page cache of the mount) | "
                  f"{c['lazy_page_cache']:.3f} s | {c['eager'] / c['lazy_page_cache']:.2f}x "
                  "throughput |", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_lazy")
    ap.add_argument("--python", default="/root/.pyenv/versions/3.11.7")
    ap.add_argument("--extra", default="/root/.pyenv/versions/3.12.1",
                    help="a second Python tree in its own layer ('' for none)")
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--workloads", default="subset,everything",
                    help="comma list (everything over moto S3 takes ~15 min: one request "
                         "costs ~70 ms there)")
    ap.add_argument("--report", action="store_true", help="print results/lazy.json as tables")
    ap.add_argument("--servers", metavar="TREE", default=None,
                    help="only compare kernel passthrough, the libfuse daemon and eager on a "
                         "small image of busybox + TREE (e.g. /usr/lib/python3.11)")
    args = ap.parse_args(argv)
    if args.servers:
        WORK.mkdir(parents=True, exist_ok=True)
        os.environ["XDG_DATA_HOME"] = str(WORK / "xdg")
        try:
            res = servers(Path(args.servers))
        finally:
            for p in TRASH:
                subprocess.Popen(["rm", "-rf", str(p)], start_new_session=True)
        print(json.dumps(res["ratios"], indent=1))
        print(save("lazy_servers", res))
        return
    if args.report:
        print(report(json.loads((RESULTS / "lazy.json").read_text())))
        return
    pyroot = Path(args.python)
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ["XDG_DATA_HOME"] = str(WORK / "xdg")
    py = str(pyroot / "bin/python3")
    workloads = {"subset": [py, "-c", SUBSET],
                 "everything": ["sh", "-c", "find / -xdev -type f -exec cat {} + >/dev/null"]}
    workloads = {w: c for w, c in workloads.items() if w in args.workloads.split(",")}
    results: dict[str, Any] = {"python": str(pyroot), "stores": {}}
    previous = RESULTS / "lazy.json"
    if previous.exists():  # runs for one store keep the other store's figures
        old = json.loads(previous.read_text())
        results["stores"].update(old.get("stores", {}))
        if "cached_read" in old:
            results["cached_read"] = old["cached_read"]
    from dsec_cli.push import testing

    urls: dict[str, str] = {}
    server = None
    file_url = (WORK / "store").as_uri()
    if not (WORK / "store" / "refs" / "pybench").exists():
        build_image(file_url, pyroot, Path(args.extra) if args.extra else None)
    if "file" in args.stores:
        urls["file"] = file_url
    if "s3" in args.stores:
        os.environ.update(testing.S3_ENV)
        server = testing.start_moto()
        testing.create_bucket(server.url, "bench")
        urls["s3"] = f"s3://bench/lazy?endpoint_url={server.url}"
        from dsec_cli.push.api import push

        t = time.perf_counter()
        push(["pybench@1"], urls["s3"], store=file_url)
        results["s3_push_s"] = round(time.perf_counter() - t, 1)
    try:
        for kind, url in urls.items():
            stored, size = image_bytes(url, "pybench@1")
            r: dict[str, Any] = {"image_stored_bytes": stored, "image_bytes": size}
            if not workloads:
                continue
            opt = {w: optimized(url, w, cmd) for w, cmd in workloads.items()}
            for w, cmd in workloads.items():
                for mode in ("eager", "lazy", "lazy+prefetch", "background"):
                    fetch = "lazy" if mode == "lazy+prefetch" else mode
                    ref = opt[w] if mode == "lazy+prefetch" else "pybench@1"
                    r.setdefault(w, {})[mode] = run_once(url, ref, fetch, cmd)
                    print(kind, w, mode, json.dumps(r[w][mode]), flush=True)
            results["stores"][kind] = r
            save("lazy", results)
        if not args.no_throughput:
            so = [str(p.relative_to(WORK / "stage-py")) for p in sorted(
                (WORK / "stage-py").rglob("*.so*"), key=lambda p: -p.stat().st_size)[:40]]
            results["cached_read"] = cached_throughput(urls.get("file", file_url),
                                                       ["/" + s for s in so])
            print("cached", results["cached_read"], flush=True)
    finally:
        if server is not None:
            server.stop()
        # left to a background rm: unlinking here (ext4 with online discard) takes minutes
        for p in TRASH:
            subprocess.Popen(["rm", "-rf", str(p)], start_new_session=True)
    print(save("lazy", results))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
