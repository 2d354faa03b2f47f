"""Concurrent builds into one store, builds killed mid-build, and corruption: a ref
never points at missing or damaged data without the reader saying so."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from dsec_cli.core.digests import object_key, sha256_hex
from dsec_cli.format.closure import closure
from dsec_cli.format.manifest import load_manifest, put_manifest
from dsec_cli.format.refs import list_refs, set_ref
from dsec_cli.push.materialize import export
from dsec_cli.push.stores import open_store

from ..treecmp import assert_same_tree
from .conftest import write_spec


def _tree(root: Path, seed: int, files: int = 30, size: int = 400_000) -> None:
    rnd = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(files):
        # half random, half repetitive: both compressible and incompressible chunks
        (root / f"f{i}.bin").write_bytes(rnd.randbytes(size // 2) + bytes([i]) * (size // 2))


def _specs(folder: Path, names: list[str], seed: int = 0) -> None:
    for n, name in enumerate(names):
        _tree(folder / name, seed + n)
        write_spec(folder, name, f'layer: {name}\nversion: "1"\nsteps:\n'
                   f"  - copy: {{src: ./{name}, dst: /data, keep_mtime: true}}\n")


def _check_store(url: str, sources: Path | None = None, tmp: Path | None = None) -> int:
    """Every ref's objects exist and, given the spec folder its layers were built from, every
    layer exports to exactly its source tree; returns the number of refs."""
    st = open_store(url)
    refs = list_refs(st)
    for r in refs:
        for key in closure(st, r.manifest):
            assert st.has(key), f"{r.ref} references missing {key}"
        if sources is not None and tmp is not None:
            name = r.ref.split("@")[0]
            out = tmp / f"check-{name}-{len(list(tmp.glob('check-*')))}"
            export(st, r.ref, out)
            assert_same_tree(sources / name, out / "data", mtimes=True, root_meta=False)
    return len(refs)


def _popen_build(folder: Path, store: Path, data: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DSEC_DATA_DIR": str(data)}
    return subprocess.Popen([sys.executable, "-c", "from dsec_cli.cli import main; main()",
                             "build", str(folder), "--store", str(store), "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_concurrent_builds_into_one_store(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    _specs(shared, ["common1", "common2"])
    own = [tmp_path / "own0", tmp_path / "own1"]
    _specs(own[0], ["mine0"], seed=10)
    _specs(own[1], ["mine1"], seed=20)
    store = tmp_path / "store"
    procs = [_popen_build(shared, store, tmp_path / f"data{i}") for i in range(2)]
    procs += [_popen_build(own[i], store, tmp_path / f"data{i}") for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    assert _check_store(store.as_uri()) == 4
    st = open_store(str(store))
    for name, src in [("common1", shared / "common1"), ("common2", shared / "common2"),
                      ("mine0", own[0] / "mine0"), ("mine1", own[1] / "mine1")]:
        out = tmp_path / f"out-{name}"
        export(st, f"{name}@1", out)
        assert_same_tree(src, out / "data", mtimes=True, root_meta=False)


def _wait_until(what: str, cond: object, p: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not cond():  # type: ignore[operator]
        assert p.poll() is None, f"the build ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within 120 s"
        time.sleep(0.01)


@pytest.mark.parametrize("point", ["first-pack", "first-ref"])
def test_build_killed_mid_build_then_rebuilt(tmp_path: Path, point: str) -> None:
    """kill -9 of a build at two points while it runs (each checked: the build had not
    ended): what was committed is whole, and the next build completes the rest."""
    folder = tmp_path / "specs"
    _specs(folder, ["big1", "big2", "big3"], seed=len(point))
    store = tmp_path / "store"
    p = _popen_build(folder, store, tmp_path / "data")

    def packs() -> bool:
        return (store / "packs").is_dir() and any(f.is_file()
                                                  for f in (store / "packs").rglob("*"))

    def refs(n: int) -> bool:
        return (store / "refs").is_dir() and len(list_refs(open_store(str(store)))) >= n

    if point == "first-pack":
        _wait_until("a pack", packs, p)
    else:
        _wait_until("a ref", lambda: refs(1), p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, p.stderr.read() if p.stderr else ""  # killed
    assert _check_store(store.as_uri(), folder, tmp_path) < 3  # whatever was committed is whole
    p = _popen_build(folder, store, tmp_path / "data")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    assert _check_store(store.as_uri(), folder, tmp_path) == 3


def _built_store(tmp_path: Path, run_dsec) -> Path:
    folder = tmp_path / "specs"
    _specs(folder, ["victim"], seed=5)
    store = tmp_path / "store"
    run_dsec("build", str(folder), "--store", str(store))
    return store


def test_corrupted_chunk_is_named_on_export(tmp_path: Path, run_dsec) -> None:
    store = _built_store(tmp_path, run_dsec)
    pack = next((store / "packs").rglob("*"))
    while pack.is_dir():
        pack = next(pack.iterdir())
    data = bytearray(pack.read_bytes())
    data[len(data) // 3] ^= 0xFF
    pack.write_bytes(bytes(data))
    p = run_dsec("export", "victim@1", str(tmp_path / "out"), "--store", str(store), check=2)
    assert "is corrupt" in p.stderr and pack.name in p.stderr, p.stderr
    assert "chunk" in p.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("kind", ["manifests", "indexes"])
def test_corrupted_metadata_is_named(kind: str, tmp_path: Path, run_dsec) -> None:
    store = _built_store(tmp_path, run_dsec)
    obj = next(p for p in (store / kind).rglob("*") if p.is_file())
    obj.write_bytes(obj.read_bytes()[:-1] + b"X")
    p = run_dsec("export", "victim@1", str(tmp_path / "out"), "--store", str(store), check=2)
    assert "corrupt" in p.stderr and obj.name[:12] in p.stderr, p.stderr


def test_chunk_sha256_catches_a_forged_chunk(tmp_path: Path, run_dsec) -> None:
    """With per-chunk sha256, a chunk replaced by other bytes that still carry the right
    xxh3 (simulated by rewriting the index's xxh3 ids) is refused."""
    folder = tmp_path / "specs"
    _specs(folder, ["signed"], seed=9)
    store = tmp_path / "store"
    run_dsec("build", str(folder), "--store", str(store), "--chunk-sha256")
    st = open_store(str(store))
    ref = list_refs(st)[0]
    m = load_manifest(st, ref.manifest)
    doc = json.loads(zstandard.ZstdDecompressor().decompress(st.get(object_key("indexes",
                                                                               m.index))))
    assert doc["chunk_sha256"] and all(len(c[6]) == 64 for c in doc["chunks"])
    out = tmp_path / "ok"
    export(st, "signed@1", out)
    assert_same_tree(folder / "signed", out / "data", root_meta=False)
    # forge: the first chunk's sha256 no longer matches its bytes
    doc["chunks"][0][6] = "00" * 32
    forged = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    st.put(object_key("indexes", sha256_hex(forged)), forged)
    m.index = sha256_hex(forged)
    set_ref(st, "signed", "2", put_manifest(st, m))
    p = run_dsec("export", "signed@2", str(tmp_path / "bad"), "--store", str(store), check=2)
    assert "sha256 mismatch" in p.stderr
