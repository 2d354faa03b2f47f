"""Each compiled module against its Python twin, on the work it does in a build or import.

    python -m benchmarks compiled [--runs 5] [--files 20000] [--mib 64] [--entries 100000]

The forms take turns in one process, each timed ``--runs`` times (the median is reported),
so both see the same load:

- `format/_walk.c`: `walk_records` and `read_many` (in the layer writer's batches) over a tree of ``files`` small files,
  against the Python walk and reads (`tree.use_compiled` off);
- `format/_cdc.c`: `chunker.cut` of ``mib`` MiB of random bytes, against fastcdc's generator;
- `format/_entryjson.c`: ``entries`` index entries to their stored and content JSON
  (`EntryJson`), against the Python way and against orjson and msgspec encoding the same
  documents (byte for byte the same output, checked), where those are installed;
- `build/_tarhdr.c`: every member of a tar of ``files`` members read by `tarfile` with the
  compiled header decoder, against tarfile's own `TarInfo`;
- `push/_known.c`: a 1 M-chunk table loaded and every id looked up, against the dict of
  tuples (`bench_known` measures the whole load of a library, with memory).

`run/lazy/_fuseloop.c` needs a kernel-served mount: `python -m benchmarks lazy` measures
it against the Python loop (DSEC_PY_FUSELOOP) in the same run (docs/benchmarks.md).
Results go to benchmarks/results/compiled.json.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import statistics
import struct
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import save


def _medians(forms: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(runs):
        for name, fn in forms.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: round(statistics.median(ts), 4) for name, ts in times.items()}


def _walk(files: int, runs: int) -> dict[str, Any]:
    from dsec_cli.format import tree

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-compiled-", dir="/var/tmp"))
    try:
        rng = random.Random(1)
        paths = []
        for i in range(files):
            d = root / f"d{i % 200:03d}" / f"e{i % 7}"
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"f{i}.py"
            p.write_bytes(rng.randbytes(rng.randrange(100, 8000)))
            paths.append(str(p))

        def read_all(paths: list[str]) -> Any:  # in the layer writer's batches
            return [tree.read_many(paths[k:k + 256], 1 << 20) for k in range(0, files, 256)]

        def form(compiled: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                tree.use_compiled = compiled
                return fn()
            return run

        saved = tree.use_compiled
        try:
            assert form(True, lambda: tree.walk_records(str(root)))() == \
                form(False, lambda: tree.walk_records(str(root)))()
            walk = _medians({"compiled": form(True, lambda: tree.walk_records(str(root))),
                             "python": form(False, lambda: tree.walk_records(str(root)))}, runs)
            read = _medians({"compiled": form(True, lambda: read_all(paths)),
                             "python": form(False, lambda: read_all(paths))}, runs)
        finally:
            tree.use_compiled = saved
        return {"walk_records": walk, "read_many": read, "files": files}
    finally:
        shutil.rmtree(root)


def _cdc(mib: int, runs: int) -> dict[str, Any]:
    from dsec_cli.format import chunker
    from dsec_cli.format.index import ChunkParams

    data = memoryview(random.Random(2).randbytes(mib << 20))
    params = ChunkParams()
    compiled = chunker._cdc

    def form(mod: Any) -> Callable[[], Any]:
        def run() -> Any:
            chunker._cdc = mod
            return list(chunker.cut(data, params))
        return run

    try:
        assert form(compiled)() == form(None)()
        return {"cut": _medians({"compiled": form(compiled), "python": form(None)}, runs),
                "mib": mib}
    finally:
        chunker._cdc = compiled


def _entryjson(entries: int, runs: int) -> dict[str, Any]:
    from dsec_cli.format import index
    from dsec_cli.format.index import Entry, EntryJson

    rng = random.Random(3)
    ids = [rng.randbytes(16) for _ in range(5000)]
    ents = []
    for i in range(entries):  # a Python library's shape: mostly small files, some links
        t = rng.choice(["reg"] * 8 + ["dir", "sym"])
        ents.append(Entry(f"usr/lib/python3/dist-packages/pkg{i % 300}/mod{i}.py", t,
                          mode=0o644, mtime=1_700_000_000_123_456_789,
                          size=rng.randrange(1, 1 << 20) if t == "reg" else 0,
                          target="../x" if t == "sym" else "",
                          chunks=[(rng.randrange(len(ids)), 0, 1000)] if t == "reg" else []))
    compiled = index._entryjson

    def ours(mod: Any) -> Callable[[], tuple[bytes, bytes]]:
        def run() -> tuple[bytes, bytes]:
            index._entryjson = mod
            ej = EntryJson(ids)
            for k in range(0, len(ents), 4096):  # the slices the layer writer hands over
                ej.add(ents[k:k + 4096])
            return ej.arrays()
        return run

    def docs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        stored, content = [], []
        for e in ents:
            d = e.to_doc()
            stored.append(d)
            content.append({**d, "c": [[ids[i].hex(), off, ln] for i, off, ln in e.chunks]}
                           if e.chunks else d)
        return stored, content

    forms: dict[str, Callable[[], Any]] = {"compiled": ours(compiled), "python": ours(None)}
    try:
        import orjson

        def with_orjson() -> tuple[bytes, bytes]:
            s, c = docs()
            return (orjson.dumps(s, option=orjson.OPT_SORT_KEYS),
                    orjson.dumps(c, option=orjson.OPT_SORT_KEYS))
        forms["orjson"] = with_orjson
    except ImportError:
        pass
    try:
        import msgspec

        enc = msgspec.json.Encoder(order="sorted")

        def with_msgspec() -> tuple[bytes, bytes]:
            s, c = docs()
            return enc.encode(s), enc.encode(c)
        forms["msgspec"] = with_msgspec
    except ImportError:
        pass
    try:
        want = ours(None)()
        for name, fn in forms.items():
            assert fn() == want, f"{name} wrote other bytes"
        return {"entries_to_json": _medians(forms, runs), "entries": entries}
    finally:
        index._entryjson = compiled


def _tarhdr(members: int, runs: int) -> dict[str, Any]:
    from dsec_cli.build import tarhdr

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for i in range(members):
            info = tarfile.TarInfo(f"usr/share/doc/pkg{i % 500}/file{i}.txt")
            info.size, info.mtime, info.mode = 10, 1_700_000_000, 0o644
            t.addfile(info, io.BytesIO(b"0123456789"))
    data = buf.getvalue()

    def form(cls: type[tarfile.TarInfo]) -> Callable[[], Any]:
        def run() -> Any:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=cls) as t:
                return [(m.name, m.size, m.mtime, m.mode) for m in t]
        return run

    compiled = tarhdr._CompiledInfo if tarhdr._tarhdr is not None else tarfile.TarInfo
    assert form(compiled)() == form(tarfile.TarInfo)()
    return {"read_members": _medians({"compiled": form(compiled),
                                      "python": form(tarfile.TarInfo)}, runs),
            "members": members}


def _known(chunks: int, runs: int) -> dict[str, Any]:
    from dsec_cli.push import dedup

    rng = random.Random(4)
    ids = [rng.randbytes(16) for _ in range(chunks)]
    blob = b"".join(dedup._REC.pack(c, i % 64, i * 4096, 3000, 4096, 1)
                    for i, c in enumerate(ids))

    def form(make: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            table = make()
            table.add(blob, 64, 0)
            return sum(1 for c in ids if table.get(c) is not None)
        return run

    k0, k1 = struct.unpack("<QQ", os.urandom(16))
    forms = {"python": form(dedup._DictTable)}
    if dedup._known is not None:
        forms = {"compiled": form(lambda: dedup._known.Table(k0, k1)), **forms}
    assert all(f() == chunks for f in forms.values())
    return {"load_and_look_up": _medians(forms, runs), "chunks": chunks}


def _row(what: str, figures: dict[str, float]) -> str:
    c, p = figures.get("compiled"), figures["python"]
    peers = ", ".join(f"{k} {v:.3f} s" for k, v in figures.items()
                      if k not in ("compiled", "python"))
    ratio = f"{p / c:.1f}×" if c else "not built"
    return (f"| {what} | {c if c is not None else '—'} s | {p} s | {ratio} | "
            f"{peers or '—'} |")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks compiled")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--entries", type=int, default=100000)
    ap.add_argument("--chunks", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    from dsec_cli.core.compiled import compiled_status

    missing = [m["name"] for m in compiled_status()["modules"] if not m["live"]]
    if missing:
        sys.exit(f"not live: {', '.join(missing)} (dsec node check --host says why)")
    res = {"runs": args.runs,
           "walk": _walk(args.files, args.runs), "cdc": _cdc(args.mib, args.runs),
           "entryjson": _entryjson(args.entries, args.runs),
           "tarhdr": _tarhdr(args.files, args.runs), "known": _known(args.chunks, args.runs)}
    out = save("compiled", res)
    print("| work | compiled | Python twin | twin / compiled | peers |")
    print("|---|---|---|---|---|")
    print(_row(f"_walk: walk_records, {args.files:,} files", res["walk"]["walk_records"]))
    print(_row(f"_walk: read_many, {args.files:,} files", res["walk"]["read_many"]))
    print(_row(f"_cdc: cut {args.mib} MiB", res["cdc"]["cut"]))
    print(_row(f"_entryjson: {args.entries:,} entries to JSON",
               res["entryjson"]["entries_to_json"]))
    print(_row(f"_tarhdr: read {args.files:,} tar members", res["tarhdr"]["read_members"]))
    print(_row(f"_known: {args.chunks:,} chunks loaded and looked up",
               res["known"]["load_and_look_up"]))
    print(f"results: {out}")
