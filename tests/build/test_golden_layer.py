"""A fixed tree builds to the very bytes it always built to: the manifest, index and pack
digests below were recorded from the layer writer before its pipeline was reworked (the
index serialized while chunks compress, the scan's records turned into entries in fewer
passes). A change of the stored form must change them on purpose, never by accident."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from dsec_cli.build import layer
from dsec_cli.build.builder import build
from dsec_cli.core.digests import object_key
from dsec_cli.format import tree
from dsec_cli.format.index import LayerIndex
from dsec_cli.format.manifest import load_manifest
from dsec_cli.push.stores import open_store

from .conftest import make_tree, write_spec

MANIFEST = "f27cd95f936952c8fab2100fac51467b05b32a84ae3e4d306c9db2f85799cb1c"
INDEX = "6e88229952f1b5f4e3f5e8eb4721a7474806fac30027ec447c27899ae35d934a"
CONTENT = "c3e33c350de373ed763d22c300d46ffbe0d37e6a2d9fe1bc36bd33e86f2ccbcf"
PACKS = ["e42972f9b2dacb33a29d98ec12e86f5e655a314c240d885de124ebbb97a5277b",
         "fb369431f4e3dd13c3f45f7e11b279a8abc9f0af4bbf982db5803045d807a664"]


def _golden_tree(root: Path) -> Path:
    """make_tree plus a few hundred small files of mixed content, in nested folders whose
    names sort differently as paths and as a walk (a-b, a.b, a/b)."""
    make_tree(root)
    for d in ("many", "many/a", "many/a-b", "many/a.b", "many/a/b"):
        (root / d).mkdir()
    for i in range(400):
        folder = ("many", "many/a", "many/a-b", "many/a.b", "many/a/b")[i % 5]
        seed = hashlib.sha256(str(i).encode()).digest()
        body = seed * (i % 90) + f"file {i}\n".encode() * (i % 13)
        (root / f"{folder}/f{i:03d}.py").write_bytes(body)
    os.setxattr(root / "many/f000.py", "user.note", b"kept")
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(p, ns=(1_600_000_000_000_000_000 + i * 1_000_003,) * 2, follow_symlinks=False)
    os.utime(root, ns=(1_650_000_000_000_000_001,) * 2)
    return root


@pytest.mark.parametrize("compiled", [True, False])
def test_the_same_tree_builds_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             compiled: bool) -> None:
    if compiled and tree._cwalk is None:
        pytest.fail("the compiled walker is not built (setup.py; dsec node check --host says why)")
    monkeypatch.setattr(tree, "use_compiled", compiled)
    # small read batches and packs: the pipeline runs many batches and seals several packs
    monkeypatch.setattr(layer, "READ_BATCH_FILES", 17)
    monkeypatch.setattr(layer, "PACK_TARGET", 400_000)
    _golden_tree(tmp_path / "spec/tree")
    write_spec(tmp_path / "spec", "g", 'layer: g\nversion: "1"\nsteps:\n'
               "  - copy: {src: ./tree, dst: /g, keep_mtime: true}\n")
    store = open_store(str(tmp_path / "store"))
    report = build([tmp_path / "spec/g.yaml"], store)
    m = load_manifest(store, report.items[0].manifest)
    index = LayerIndex.from_bytes(store.get(object_key("indexes", m.index)))
    got = {"manifest": report.items[0].manifest, "index": m.index,
           "content": m.content_digest, "packs": sorted(index.packs)}
    assert got == {"manifest": MANIFEST, "index": INDEX, "content": CONTENT,
                   "packs": sorted(PACKS)}


def test_the_collector_is_paused_only_while_a_layer_builds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build pauses the cyclic garbage collector while it makes a layer and leaves it as
    it found it, with the build's objects out of the youngest generation (so the next young
    collection does not scan them all)."""
    import gc

    seen: list[bool] = []
    orig = layer.write_layer  # the builder imports it when a layer is built

    def spy(*a: object, **k: object) -> object:
        seen.append(gc.isenabled())
        return orig(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(layer, "write_layer", spy)
    _golden_tree(tmp_path / "spec/tree")
    write_spec(tmp_path / "spec", "g", 'layer: g\nversion: "1"\nsteps:\n'
               "  - copy: {src: ./tree, dst: /g}\n")
    store = open_store(str(tmp_path / "store"))
    assert gc.isenabled()
    build([tmp_path / "spec/g.yaml"], store)
    assert seen == [False] and gc.isenabled()
    assert gc.get_count()[0] < 5000
    gc.disable()
    try:
        build([tmp_path / "spec/g.yaml"], store, force=True)
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
