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
