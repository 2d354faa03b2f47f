"""Fixtures of the lazy-mount tests: one moto S3 server per session holding a test layer (every
kind of entry, whiteouts and an opaque dir, multi-chunk files) and the busybox image stacked
under it, and helpers to mount layers for real (FUSE, as root) and read their statistics."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec_cli.push import testing
from tests.conftest import data_home, skip_unless

REPO = Path(__file__).resolve().parents[2]

requires_root_and_fuse = skip_unless(os.geteuid() == 0 and os.path.exists("/dev/fuse"),
                                     "lazy mounts need root and /dev/fuse")


def make_lazy_tree(root: Path) -> Path:
    """An overlay upper dir: the build tests' tree plus whiteouts, an opaque dir and files
    of several chunks each."""
    from tests.build.conftest import make_tree

    make_tree(root)
    os.mknod(root / "data/gone", 0o20000, os.makedev(0, 0))  # whiteout
    (root / "opaque").mkdir()
    (root / "opaque/kept").write_text("kept\n")
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    big = root / "big"
    big.mkdir()
    for n in range(3):  # ~3 MiB of incompressible bytes each: many chunks, several reads
        (big / f"blob{n}.bin").write_bytes(os.urandom(3 << 20))
    (root / "bin/hello").write_text("#!/bin/sh\necho hello from a lazy layer\n")
    os.chmod(root / "bin/hello", 0o755)
    return root


@dataclass
class Published:
    url: str
    layer: str  # name@version of the test layer
    image: str  # busybox + the test layer
    tree: Path


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    saved = {k: os.environ.get(k) for k in testing.S3_ENV}
    os.environ.update(testing.S3_ENV)
    server = testing.start_moto()
    yield server.url
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _one_frame_per_chunk() -> Iterator[None]:
    """The test layer stores each chunk in a frame of its own (as format 1 did, and as a
    store written before chunk groups holds), so the read-ahead tests can count fetched
    bytes chunk by chunk; grouped layers are read lazily in tests/format/test_groups.py."""
    from dsec_cli.build import layer

    saved = layer.GROUP_CHUNKS
    layer.GROUP_CHUNKS = 1
    try:
        yield
    finally:
        layer.GROUP_CHUNKS = saved


def publish(url: str, tree: Path, data: Path) -> Published:
    """Build busybox and the test layer into a store, and an image stacking them."""
    from dsec_cli.build.builder import build
    from dsec_cli.build.image import write_image
    from dsec_cli.build.layer import build_layer_from_dir
    from dsec_cli.format.refs import resolve
    from dsec_cli.push.stores import open_store

    with data_home(data):
        subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
        build([REPO / "layerspecs/busybox/busybox.yaml"], url)
        with open_store(url) as st, _one_frame_per_chunk():
            layer, _ = build_layer_from_dir(st, tree, "lazytest", "1")
            base = resolve(st, "busybox@1.35-1")
            write_image(st, "lazyimg", "1", [base, layer], commit=True)
    return Published(url, "lazytest@1", "lazyimg@1", tree)


@pytest.fixture(scope="session")
def lazy_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lazy_tree(tmp_path_factory.mktemp("lazytree") / "upper")


@pytest.fixture(scope="session")
def s3_image(s3_endpoint: str, lazy_tree: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Published:
    bucket = f"lazy{uuid.uuid4().hex[:10]}"
    testing.create_bucket(s3_endpoint, bucket)
    return publish(f"s3://{bucket}/pre?endpoint_url={s3_endpoint}", lazy_tree,
                   tmp_path_factory.mktemp("data"))


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """mount(url, ref, cache=..., budget=...) -> LazyMount of every layer of ref;
    all unmounted at the end of the test."""
    from dsec_cli.push.materialize import resolve_image
    from dsec_cli.push.stores import open_store
    from dsec_cli.run.lazy import cleanup, mount_layers

    states: list[Path] = []

    def mount(url: str, ref: str, *, cache: Path | None = None, budget: int = 1 << 30,
              mode: str = "lazy", max_read: int | None = None) -> object:
        with open_store(url) as st:
            img = resolve_image(st, ref)
        layers = [{"index": m.index or "", "content_digest": m.content_digest}
                  for _, m in img.layers]
        state = tmp_path / f"mount{len(states)}"
        state.mkdir()
        states.append(state)
        return mount_layers(state, url, layers, cache=cache or tmp_path / "chunks",
                            budget=budget, mode=mode, max_read=max_read)

    yield mount
    for s in states:
        cleanup(s)


def stats(mount: object) -> dict[str, float]:
    """The daemon's statistics, once it has written what it has counted so far."""
    state: Path = mount.state  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    last = None
    while time.monotonic() < deadline:  # written every 0.1 s when they change: wait for rest
        doc = json.loads((state / "stats.json").read_text())
        if doc == last:
            return doc  # type: ignore[no-any-return]
        last = doc
        time.sleep(0.7)
    raise AssertionError(f"the daemon's statistics did not settle within 30 s: {last}")


def read_all(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def node_env(s3_image: Published, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, str]]:
    state = tmp_path_factory.mktemp("lazynode")
    env = {"DSEC_STATE_DIR": str(state), "DSEC_STORE": s3_image.url,
           "XDG_DATA_HOME": str(tmp_path_factory.mktemp("xdg"))}
    yield env
    from dsec_cli.run.node import Node

    n = Node(state, s3_image.url)
    for r in n.db.all():
        n.remove(r.id)
    n.reconcile()
