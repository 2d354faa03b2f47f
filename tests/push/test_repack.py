"""Repacking: a pack that is mostly dead is rewritten with its live chunks only; the layers
using it keep their content digest, their refs move, and the old pack is collected."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from dsec_cli.build.builder import build
from dsec_cli.format.manifest import load_manifest
from dsec_cli.format.refs import delete_ref, get_ref
from dsec_cli.push.gc import gc_store
from dsec_cli.push.materialize import export
from dsec_cli.push.stores import open_store

from ..treecmp import assert_same_tree


def _spec(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    (folder / name).mkdir(parents=True)
    for f, data in files.items():
        (folder / name / f).write_bytes(data)
    spec = folder / f"{name}.yaml"
    spec.write_text(f'layer: {name}\nversion: "1"\nsteps:\n'
                    f"  - copy: {{src: ./{name}, dst: /d, keep_mtime: true}}\n")
    return spec


def test_mostly_dead_pack_is_repacked_and_collected(tmp_path: Path) -> None:
    rnd = random.Random(3)
    keep, drop = rnd.randbytes(300_000), rnd.randbytes(900_000)
    store = open_store(str(tmp_path / "store"))
    build([_spec(tmp_path / "a", "both", {"keep.bin": keep, "drop.bin": drop})], store)
    build([_spec(tmp_path / "b", "kept", {"keep.bin": keep})], store)
    before = load_manifest(store, get_ref(store, "kept@1").manifest)
    old_pack = before.packs
    assert len(old_pack) == 1  # "kept" reuses the chunks "both" stored
    delete_ref(store, "both@1")
    report = gc_store(store, grace=0)
    assert [c["pack"] for c in report.repack_candidates] == old_pack
    assert report.repacked["refs_moved"] == ["kept@1"]
    after = load_manifest(store, get_ref(store, "kept@1").manifest)
    assert after.content_digest == before.content_digest and after.packs != old_pack
    # the next run collects the old pack: the store holds about the live bytes only
    gc_store(store, grace=0)
    packs = [p for p in (tmp_path / "store/packs").rglob("*") if p.is_file()]
    assert [p.name for p in packs] == after.packs
    assert sum(p.stat().st_size for p in packs) < 400_000
    out = tmp_path / "out"
    export(store, "kept@1", out)
    assert_same_tree(tmp_path / "b/kept", out / "d", root_meta=False)


def test_gc_cli_reports_repack_and_threshold_one_disables_it(tmp_path: Path) -> None:
    rnd = random.Random(4)
    keep, drop = rnd.randbytes(200_000), rnd.randbytes(800_000)
    url = str(tmp_path / "store")
    store = open_store(url)
    build([_spec(tmp_path / "a", "both", {"keep.bin": keep, "drop.bin": drop})], store)
    build([_spec(tmp_path / "b", "kept", {"keep.bin": keep})], store)
    delete_ref(store, "both@1")
    dsec = [sys.executable, "-m", "dsec_cli"]
    env = {**os.environ}
    off = json.loads(subprocess.run([*dsec, "gc", "--store", url, "--grace", "0",
                                     "--repack-threshold", "1", "--json"], env=env,
                                    capture_output=True, text=True, check=True).stdout)
    assert off["store"]["repack_candidates"] == [] and not off["store"]["repacked"]
    on = subprocess.run([*dsec, "gc", "--store", url, "--grace", "0"], env=env,
                        capture_output=True, text=True, check=True)
    assert "repacked 1 packs into 1" in on.stdout and "moved 1 refs" in on.stdout


def test_ref_moved_meanwhile_is_skipped_not_overwritten(tmp_path: Path) -> None:
    """docs/stores.md: a ref another client moves while repack rewrites its layer keeps the
    other client's manifest; repack reports it skipped. The move is made by a second writer at
    a fixed point: when repack writes its first new manifest (after it read the refs)."""
    from dsec_cli.format.refs import set_ref
    from dsec_cli.push.repack import repack

    rnd = random.Random(5)
    keep, drop = rnd.randbytes(300_000), rnd.randbytes(900_000)
    store = open_store(str(tmp_path / "store"))
    build([_spec(tmp_path / "a", "both", {"keep.bin": keep, "drop.bin": drop})], store)
    build([_spec(tmp_path / "b", "kept", {"keep.bin": keep})], store)
    build([_spec(tmp_path / "c", "other", {"x.bin": rnd.randbytes(1000)})], store)
    old = get_ref(store, "kept@1").manifest
    other = get_ref(store, "other@1").manifest
    packs = set(load_manifest(store, old).packs)
    delete_ref(store, "both@1")

    class SecondWriter:
        """The store as repack sees it; another client moves kept@1 at the first manifest."""

        moved = False

        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        def put(self, key: str, data: bytes) -> None:
            store.put(key, data)
            if key.startswith("manifests/") and not SecondWriter.moved:
                SecondWriter.moved = True
                set_ref(store, "kept", "1", other)

    report = repack(SecondWriter(), packs)  # type: ignore[arg-type]
    assert SecondWriter.moved
    assert report.refs_skipped == ["kept@1"] and report.refs_moved == [], report
    assert get_ref(store, "kept@1").manifest == other  # the other client's move stands
    out = tmp_path / "out"
    export(store, "kept@1", out)
    assert sorted(p.name for p in (out / "d").iterdir()) == ["x.bin"]
