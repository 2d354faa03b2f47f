"""What a writer pays to know the chunks a large library already holds.

    python -m benchmarks known [--layers 1000,4000] [--chunks 1000] [--runs 3]

Every build, import and push starts with `KnownChunks.load`: the chunk tables of every index
the store's refs reach, from this machine's cache of them. This makes a file store holding
``layers`` layers of ``chunks`` chunks each (refs and manifests written by dsec's own
functions; the indexes' chunk tables in the cache, as on the machine that wrote them), then,
in a fresh process per run, times the load and reads the process's peak memory for:

- the compiled table (`push/_known.c`), what set-up builds;
- its Python form (a dict of tuples), what runs without it;
- one frozen dataclass per chunk in a dict, what the loader did before the table (a peer
  written out here, on the same cached tables).

Then the lookups a layer's read makes: every id of one table, hits, and as many misses.

With ``--s3-layers N`` (default 400), a library of N layers in an S3 bucket (moto's server)
behind a relay that holds every request ``--rtt-ms`` (default 20 ms, a bucket in another
zone) before passing it on: `KnownChunks.load` from it, the refs and manifests read one at a
time against side by side (`core.reads`), taking turns in one process.
Results go to benchmarks/results/known.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, save

_CHILD = r"""
import json, os, resource, struct, sys, time
from dataclasses import dataclass
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from dsec_cli.push import dedup
from dsec_cli.push.stores import open_store
store_url, tables, form = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
probe = [bytes.fromhex(x) for x in json.loads(sys.argv[5])]

@dataclass(frozen=True)
class OldChunk:
    pack: str
    offset: int
    clen: int
    ulen: int
    codec: int

def old_load(store):  # the loader before the compiled table: one object per chunk
    chunks = {}
    seen = set()
    def collect(digest):
        if digest in seen:
            return
        seen.add(digest)
        m = dedup.load_manifest(store, digest)
        for layer in m.layers:
            collect(layer)
        data = (tables / m.index).read_bytes()
        npacks = struct.unpack_from("<I", data)[0]
        packs = [data[4 + 64 * i:4 + 64 * (i + 1)].decode() for i in range(npacks)]
        rows = list(dedup._REC.iter_unpack(data[4 + 64 * npacks:]))
        if not all(dedup.is_digest(p) for p in packs) or any(r[1] >= npacks for r in rows):
            raise ValueError("damaged")
        for cid, p, o, cl, ul, codec in rows:
            chunks.setdefault(cid, OldChunk(packs[p], o, cl, ul, codec))
    for ref in dedup.list_refs(store):
        collect(ref.manifest)
    return chunks

dedup.use_compiled = form == "compiled"
with open_store(store_url) as st:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    known = old_load(st) if form == "old" else dedup.KnownChunks.load(st, tables)
    load_s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    get = known.get
    t = time.perf_counter()
    hits = sum(get(cid) is not None for cid in probe)
    look_s = time.perf_counter() - t
    n = len(known) if form == "old" else len(known.table)
print(json.dumps({"load_s": load_s, "rss_mb": (peak - base) / 1024, "chunks": n,
                  "hits": hits, "lookup_us": look_s / len(probe) * 1e6}))
"""


def _library(root: Path, layers: int, chunks: int, url: str = ""
             ) -> tuple[str, Path, list[str]]:
    """A store of ``layers`` layer refs whose indexes' chunk tables are in ``root/tables``;
    returns the store URL, the tables' directory and a probe: one table's ids and as many
    ids no table holds."""
    from dsec_cli.format.manifest import Manifest, put_manifest
    from dsec_cli.format.refs import set_ref
    from dsec_cli.push.dedup import _REC
    from dsec_cli.push.stores import open_store

    rnd = random.Random(layers * 7919 + chunks)
    tables = root / "tables"
    tables.mkdir(parents=True)
    url = url or (root / "store").as_uri()
    shared = [rnd.randbytes(16) for _ in range(chunks)]  # what versions of a base share
    probe: list[str] = []
    with open_store(url) as st, st.write_batch():
        for n in range(layers):
            index = rnd.randbytes(32).hex()
            packs = [rnd.randbytes(32).hex() for _ in range(2)]
            ids = [shared[i] if rnd.random() < 0.1 else rnd.randbytes(16)
                   for i in range(chunks)]
            rows = b"".join(_REC.pack(cid, i % 2, i * 40_000, 30_000, 65_536, 1)
                            for i, cid in enumerate(ids))
            (tables / index).write_bytes(struct.pack("<I", 2) + "".join(packs).encode() + rows)
            m = Manifest(kind="layer", name=f"lib{n // 100}", version=str(n),
                         content_digest=rnd.randbytes(32).hex(), index=index, packs=packs)
            set_ref(st, m.name, m.version, put_manifest(st, m))
            if n == layers // 2:
                probe = [cid.hex() for cid in ids]
    probe += [rnd.randbytes(16).hex() for _ in range(len(probe))]
    return url, tables, probe


def _child(url: str, tables: Path, form: str, probe: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), url, str(tables), form,
                          json.dumps(probe)], check=True, capture_output=True, text=True)
    got: dict[str, Any] = json.loads(out.stdout)
    return got


class _Distant:
    """An HTTP relay on loopback that holds each request ``rtt`` seconds, then passes it on."""

    def __init__(self, upstream: str, rtt: float) -> None:
        import http.client
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlparse

        up = urlparse(upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no delayed-ACK stall between headers and body

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(rtt)
                conn = http.client.HTTPConnection(up.hostname, up.port)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


def _remote(layers: int, rtt_ms: float, runs: int) -> dict[str, Any]:
    import time

    from dsec_cli.core import reads
    from dsec_cli.push import dedup, testing
    from dsec_cli.push.stores import open_store

    os.environ.update(testing.S3_ENV)
    moto = testing.start_moto()
    relay = _Distant(moto.url, rtt_ms / 1000)
    root = Path(tempfile.mkdtemp(prefix="dsec-bench-known-s3-", dir="/var/tmp"))
    try:
        testing.create_bucket(moto.url, "lib")
        _, tables, _ = _library(root, layers, 100, f"s3://lib/x?endpoint_url={moto.url}")
        times: dict[str, list[float]] = {"one at a time": [], "side by side": []}
        with open_store(f"s3://lib/x?endpoint_url={relay.url}") as st:
            for _ in range(runs):
                for form in times:
                    reads.REMOTE_READS = 1 if form == "one at a time" else 16
                    t = time.perf_counter()
                    known = dedup.KnownChunks.load(st, tables)
                    times[form].append(time.perf_counter() - t)
                    assert len(known.table) > 0
        reads.REMOTE_READS = 16
        one, side = (statistics.median(times[k]) for k in ("one at a time", "side by side"))
        return {"layers": layers, "rtt_ms": rtt_ms, "one_at_a_time_s": round(one, 2),
                "side_by_side_s": round(side, 2), "speedup": round(one / side, 1)}
    finally:
        relay.stop()
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks known")
    ap.add_argument("--layers", default="1000,4000")
    ap.add_argument("--chunks", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--s3-layers", type=int, default=400)
    ap.add_argument("--rtt-ms", type=float, default=20)
    args = ap.parse_args(argv)
    from dsec_cli.push import dedup

    if not dedup.use_compiled:
        sys.exit("the compiled table is not built (dsec node check --host says why)")
    results = []
    for layers in (int(x) for x in args.layers.split(",")):
        root = Path(tempfile.mkdtemp(prefix="dsec-bench-known-", dir="/var/tmp"))
        try:
            url, tables, probe = _library(root, layers, args.chunks)
            runs: dict[str, list[dict[str, Any]]] = {"compiled": [], "python": [], "old": []}
            for _ in range(args.runs):  # the forms take turns: the same load for each
                for form in runs:
                    runs[form].append(_child(url, tables, form, probe))
            row: dict[str, Any] = {"layers": layers, "chunks_per_layer": args.chunks}
            for form, rs in runs.items():
                row[form] = {k: round(statistics.median(r[k] for r in rs), 4)
                             for k in ("load_s", "rss_mb", "lookup_us")}
                row[form]["chunks"] = rs[0]["chunks"]
                assert rs[0]["hits"] == len(probe) // 2, (form, rs[0]["hits"])
            assert row["compiled"]["chunks"] == row["python"]["chunks"] == row["old"]["chunks"]
            for peer in ("python", "old"):
                row[f"{peer}_load_vs_compiled"] = round(row[peer]["load_s"]
                                                       / row["compiled"]["load_s"], 1)
                row[f"{peer}_memory_vs_compiled"] = round(row[peer]["rss_mb"]
                                                         / max(row["compiled"]["rss_mb"], 1), 1)
            print(json.dumps(row), flush=True)
            results.append(row)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    remote = _remote(args.s3_layers, args.rtt_ms, args.runs) if args.s3_layers else None
    print(json.dumps(remote), flush=True)
    out = {"runs": args.runs, "libraries": results, "from_s3": remote,
           "note": "each figure the median of fresh processes; rss_mb is the load's growth of "
                   "the process's peak resident memory"}
    print(save("known", out))

