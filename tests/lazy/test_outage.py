"""A store that goes away mid-read: the reader gets EIO and the daemon logs why; no hang."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.push import testing

from .conftest import publish


def test_store_outage_is_eio(mounter: Any, tmp_path: Path, lazy_tree: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    os.environ.update(testing.S3_ENV)
    server = testing.start_moto()  # its own server: this test stops it
    try:
        testing.create_bucket(server.url, "outage")
        pub = publish(f"s3://outage/p?endpoint_url={server.url}", lazy_tree, tmp_path / "data")
        monkeypatch.setenv("DSEC_STORE_RETRIES", "2")  # the daemon inherits it
        m = mounter(pub.url, pub.layer)
        lower = m.lower_dirs[0]
        assert (lower / "etc/small.conf").read_bytes() == (lazy_tree / "etc/small.conf"
                                                           ).read_bytes()
    finally:
        server.stop()
    # metadata is in memory: listing still works; bytes need the store
    assert "blob0.bin" in os.listdir(lower / "big")
    # EIO, not a hang: read in a child with a generous bound (a hang would be forever)
    p = subprocess.run(["cat", str(lower / "big/blob0.bin")], capture_output=True, timeout=60)
    assert p.returncode != 0 and os.strerror(errno.EIO).encode() in p.stderr, p
    log = (m.state / "mountd.log").read_text()
    assert "big/blob0.bin" in log and "failed" in log


def test_corrupt_chunk_in_the_store_is_eio_and_logged(mounter: Any, tmp_path: Path,
                                                      lazy_tree: Path, s3_endpoint: str) -> None:
    """Corrupt data during a lazy read (docs/lazy.md, Failure behaviour): the chunk fails its
    check, the read gets EIO, never the wrong bytes, and the daemon logs the file."""
    import uuid

    from dsec_cli.push.stores import open_store

    bucket = f"corrupt{uuid.uuid4().hex[:8]}"
    testing.create_bucket(s3_endpoint, bucket)
    pub = publish(f"s3://{bucket}/p?endpoint_url={s3_endpoint}", lazy_tree, tmp_path / "data")
    with open_store(pub.url) as st:
        packs = [i.key for i in st.list("packs/")]
        assert packs
        for key in packs:  # same length, one byte in every 4 KiB changed
            data = bytearray(st.get(key))
            for i in range(100, len(data), 4096):
                data[i] ^= 0xFF
            st.put(key, bytes(data))
    m = mounter(pub.url, pub.layer, cache=tmp_path / "empty-cache")  # nothing cached yet
    lower = m.lower_dirs[0]
    assert "blob0.bin" in os.listdir(lower / "big")  # metadata is in memory, unaffected
    p = subprocess.run(["cat", str(lower / "big/blob0.bin")], capture_output=True, timeout=60)
    assert p.returncode != 0 and os.strerror(errno.EIO).encode() in p.stderr, p.stderr
    assert p.stdout == (lazy_tree / "big/blob0.bin").read_bytes()[:len(p.stdout)]  # no bad bytes
    log = (m.state / "mountd.log").read_text()
    assert "big/blob0.bin" in log and "failed" in log, log
