"""Lazy mounts against a real S3 server (moto on loopback), mounted for real with FUSE: the
tree, what one read fetches, the chunk cache, eviction, verification."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from dsec_cli.push.dedup import load_index
from dsec_cli.push.materialize import LayerCache, resolve_image
from dsec_cli.push.stores import open_store
from tests.treecmp import describe

from .conftest import Published, read_all, stats


def assert_same_layer(a: Path, b: Path) -> None:
    """Trees equal byte for byte and in metadata, except what a layer does not keep: the
    root's own metadata (the eager cache dir's mtime records its last use) and a whiteout's
    mtime (none is stored; writers leave their own)."""
    want, got = describe(a, root_meta=False), describe(b, root_meta=False)
    for d in (want, got):
        d["data/gone"].pop("mtime")
    assert got == want


def _index(url: str, ref: str) -> Any:
    with open_store(url) as st:
        img = resolve_image(st, ref)
        return load_index(st, img.layers[-1][1].index or "")


def test_mounted_tree_equals_materialized_layer(s3_image: Published, mounter: Any,
                                                tmp_path: Path) -> None:
    m = mounter(s3_image.url, s3_image.layer)
    with open_store(s3_image.url) as st:
        img = resolve_image(st, s3_image.layer)
        eager = LayerCache(tmp_path / "eager").ensure(st, img.layers[0][1])
    lower = m.lower_dirs[0]
    assert_same_layer(eager, lower)
    assert_same_layer(s3_image.tree, lower)
    st_ = os.lstat(lower / "data/gone")  # overlay lower form: whiteout, opaque dir
    assert stat.S_ISCHR(st_.st_mode) and st_.st_rdev == 0
    assert os.getxattr(lower / "opaque", "trusted.overlay.opaque") == b"y"
    assert os.lstat(lower / "data/hard-a").st_ino == os.lstat(lower / "etc/hard-b").st_ino
    assert read_all(lower / "big/blob1.bin") == (s3_image.tree / "big/blob1.bin").read_bytes()


def test_one_file_fetches_only_its_chunks_then_hits_cache(s3_image: Published, mounter: Any,
                                                          tmp_path: Path) -> None:
    index = _index(s3_image.url, s3_image.layer)
    entry = next(e for e in index.entries if e.path == "big/blob2.bin")
    own = {ci for ci, _, _ in entry.chunks}
    own_bytes = sum(index.chunks[ci].clen for ci in own)
    assert len(own) > 4

    m = mounter(s3_image.url, s3_image.layer)
    assert stats(m)["requests"] == 0  # mounting reads the index only
    data = read_all(m.lower_dirs[0] / "big/blob2.bin")
    assert data == (s3_image.tree / "big/blob2.bin").read_bytes()
    first = stats(m)
    assert first["bytes_fetched"] == own_bytes  # exactly its chunks, nothing else
    # neighbouring chunks were coalesced: far fewer requests than chunks
    assert 1 <= first["requests"] < len(own) / 2
    assert first["bytes_from_cache"] == 0

    # a second read is served by the kernel's page cache: nothing reaches the daemon
    assert read_all(m.lower_dirs[0] / "big/blob2.bin") == data
    second = stats(m)
    assert {k: v for k, v in second.items() if k != "bytes_served"} == \
        {k: v for k, v in first.items() if k != "bytes_served"}
    # the kernel may ask the daemon again for the partial EOF page, or for one readahead
    # window when the machine is under memory pressure; never for the file, and never from
    # the store (the counters above are unchanged)
    assert second["bytes_served"] - first["bytes_served"] <= 128 << 10

    # a new mount over the same node cache: every byte from the cache, no request
    m2 = mounter(s3_image.url, s3_image.layer)
    assert read_all(m2.lower_dirs[0] / "big/blob2.bin") == data
    again = stats(m2)
    assert again["requests"] == 0 and again["bytes_fetched"] == 0
    if json.loads((m2.state / "config.json").read_text())["server"] == "kernel":
        # the whole file is in the node's file cache: the kernel reads it, the daemon
        # neither assembles nor serves anything
        assert again["bytes_from_cache"] == 0 and again["bytes_served"] == 0
    else:
        # (parallel kernel reads may both load a chunk they share from disk)
        assert again["bytes_from_cache"] >= len(data) and again["bytes_served"] == len(data)


def test_small_budget_evicts_and_keeps_serving(s3_image: Published, mounter: Any,
                                               tmp_path: Path) -> None:
    from dsec_cli.run.lazy.cache import ChunkCache

    budget = 1 << 20
    cache = tmp_path / "small-cache"
    m = mounter(s3_image.url, s3_image.layer, cache=cache, budget=budget)
    for _ in range(2):  # the second pass re-fetches what the first evicted
        for n in range(3):
            got = read_all(m.lower_dirs[0] / f"big/blob{n}.bin")
            assert got == (s3_image.tree / f"big/blob{n}.bin").read_bytes()
    assert_same_layer(s3_image.tree, m.lower_dirs[0])
    # one chunk (at most 256 KiB) may land before the pass that makes room for it; that pass
    # runs in the mount's process after the write, so the bound is checked once the mount
    # has had up to 10 s to finish it
    deadline = time.monotonic() + 10
    while (usage := ChunkCache(cache, budget).usage()) > budget + (256 << 10):
        assert time.monotonic() < deadline, f"the cache stayed at {usage} bytes"
        time.sleep(0.1)
    assert stats(m)["bytes_fetched"] > budget


def test_corrupt_cache_file_is_fetched_again(s3_image: Published, mounter: Any,
                                             tmp_path: Path) -> None:
    cache = tmp_path / "c"
    m = mounter(s3_image.url, s3_image.layer, cache=cache)
    want = read_all(m.lower_dirs[0] / "data/medium.bin")
    # the chunk cache is written behind, by its own thread: wait until it is written out
    # (no file in progress, the same files twice in a row)
    deadline, seen = time.monotonic() + 60, None
    while True:
        names = sorted(p for p in cache.glob("??/*") if p.is_file())
        if names and names == seen and not any("." in p.name for p in names):
            break
        assert time.monotonic() < deadline, f"the disk cache never settled: {names}"
        seen = names
        time.sleep(0.2)
    files = names
    for p in files:
        p.write_bytes(b"x" * p.stat().st_size)  # same length, wrong bytes
    # (whole files assembled by a kernel-served mount are checked apart: test_kernel.py)
    shutil.rmtree(tmp_path / "files", ignore_errors=True)
    m2 = mounter(s3_image.url, s3_image.layer, cache=cache)
    assert read_all(m2.lower_dirs[0] / "data/medium.bin") == want
    assert stats(m2)["requests"] >= 1


def test_layer_without_xattrs_is_served_without_xattr_callbacks(
        s3_image: Published, mounter: Any, tmp_path: Path) -> None:
    import errno

    import pytest

    m = mounter(s3_image.url, "busybox@1.35-1")
    with open_store(s3_image.url) as st:
        img = resolve_image(st, "busybox@1.35-1")
        eager = LayerCache(tmp_path / "eager").ensure(st, img.layers[0][1])
    assert describe(m.lower_dirs[0], root_meta=False) == describe(eager, root_meta=False)
    with pytest.raises(OSError) as e:  # the kernel answers: the daemon has no xattr callback
        os.getxattr(m.lower_dirs[0] / "bin/busybox", "user.x")
    # ENODATA would be the answer of a daemon with the callback
    assert e.value.errno == errno.EOPNOTSUPP, e.value


def test_running_mount_keeps_its_profile_current(s3_image: Published, mounter: Any) -> None:
    """The access profile (rewritten at most once a second while the daemon runs) lists a
    file read after the last statistics change, without waiting for the mount to end."""
    import time

    m = mounter(s3_image.url, s3_image.layer)
    assert read_all(m.lower_dirs[0] / "etc/small.conf")
    stats(m)  # settled
    assert read_all(m.lower_dirs[0] / "bin/tool")  # in the chunk read with small.conf
    deadline = time.monotonic() + 30
    files: dict[str, float] = {}
    while time.monotonic() < deadline:
        files = dict(json.loads((m.state / "profile.json").read_text())["layers"][0]["files"])
        if "bin/tool" in files:
            break
        time.sleep(0.2)
    assert {"etc/small.conf", "bin/tool"} <= set(files)
