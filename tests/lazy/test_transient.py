"""Transient store errors are retried on every path that reads a store: a build, image
resolution on a node and the lazy mount daemon's reads all go through a real S3 server
(moto) behind a proxy that fails the first try of every request with 503 SlowDown."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.push import testing

from ..flakyproxy import FlakyProxy
from .conftest import publish, read_all


@pytest.fixture
def flaky_url(s3_endpoint: str) -> Any:
    bucket = f"flaky{uuid.uuid4().hex[:10]}"
    testing.create_bucket(s3_endpoint, bucket)
    proxy = FlakyProxy(s3_endpoint)
    try:
        yield f"s3://{bucket}/p?endpoint_url={proxy.url}", proxy
    finally:
        proxy.stop()


def test_build_resolve_and_lazy_read_survive_transient_errors(
        flaky_url: Any, lazy_tree: Path, tmp_path: Path, mounter: Any) -> None:
    url, proxy = flaky_url
    pub = publish(url, lazy_tree, tmp_path / "data")  # builds busybox, writes the image
    after_build = proxy.failed
    assert after_build > 10, "the proxy did not fail the build's requests"

    proxy.reset()
    m = mounter(url, pub.image)
    mounted = proxy.failed
    lower = m.lower_dirs[-1]
    for rel in ("bin/hello", "big/blob0.bin", "big/blob1.bin"):
        assert read_all(lower / rel) == (lazy_tree / rel).read_bytes(), rel
    log = (m.state / "mountd.log").read_text()
    assert "failed" not in log, log
    assert proxy.failed > mounted  # the daemon's own reads met the errors too
    after_lazy = proxy.failed

    from dsec_cli.run.node import Node

    proxy.reset()
    node = Node(tmp_path / "node", url)
    img = node.resolve_image(pub.image)  # resolves and materializes the layers
    assert len(img.lower_dirs) == 2
    assert (img.lower_dirs[-1] / "bin/hello").read_bytes() == \
        (lazy_tree / "bin/hello").read_bytes()
    assert proxy.failed > after_lazy


def test_open_store_is_the_only_way_in(tmp_path: Path) -> None:
    from dsec_cli.push.stores import open_store
    from dsec_cli.push.stores.retrying import RetryingStore

    st = open_store(str(tmp_path / "store"))
    assert isinstance(st, RetryingStore)
    # the bare store is not handed out: no attribute leads around the retries
    for name in ("inner", "raw", "root", "client"):
        assert not hasattr(st, name), name
    again = RetryingStore(st)
    assert not isinstance(again._inner, RetryingStore)  # one layer: never retries of retries
