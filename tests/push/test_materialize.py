"""Eager materialization into the node's layer cache from a remote store: a few large ranged
reads per pack, not one read per file, and the same tree as from a local store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dsec_cli.format.manifest import load_manifest
from dsec_cli.format.refs import resolve
from dsec_cli.push.materialize import LayerCache
from dsec_cli.push.stores import open_store
from dsec_cli.push.transfer import copy_refs

from ..treecmp import assert_same_tree
from .helpers import build_layer


@pytest.mark.parametrize("remote", ["s3", "oci"])
def test_eager_fetch_reads_packs_in_few_requests(remote: str, make_url: Callable[[str], str],
                                                 tmp_path: Path) -> None:
    tree = tmp_path / "specs" / "tree"
    tree.mkdir(parents=True)
    # files of 20-40 KiB: each is cut alone (not batched), so a file-by-file fetch would
    # make one request per file
    for i in range(300):
        (tree / f"f{i:03d}.bin").write_bytes(bytes([i % 251]) * (20_000 + 67 * i))
    local_url = make_url("file")
    build_layer(local_url, tmp_path / "specs", "many", "1")
    local, far = open_store(local_url), open_store(make_url(remote))
    copy_refs(local, far, ["many@1"])

    pack_reads: list[tuple[str, int, int | None]] = []
    real_get = far.get

    def counting_get(key: str, start: int = 0, length: int | None = None) -> bytes:
        if key.startswith("packs/"):
            pack_reads.append((key, start, length))
        return real_get(key, start, length)

    far.get = counting_get  # type: ignore[method-assign]
    m = load_manifest(far, resolve(far, "many@1"))
    got = LayerCache(tmp_path / "node-far").ensure(far, m)
    assert m.files >= 300
    # a pack of up to 64 MiB is read in spans of at most 32 MiB: a few reads per pack
    assert 0 < len(pack_reads) <= 4 * len(m.packs), (len(pack_reads), len(m.packs))
    want = LayerCache(tmp_path / "node-local").ensure(local, load_manifest(
        local, resolve(local, "many@1")))
    assert_same_tree(want, got)
    # the spool is gone once the layer is in place
    assert [p.name for p in (tmp_path / "node-far" / "layers").iterdir()
            if p.name.startswith(".tmp-")] == []
