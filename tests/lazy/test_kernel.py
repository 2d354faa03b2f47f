"""Lazy reads served by the kernel (FUSE passthrough, kernelfs.py) on this kernel, and the
libfuse daemon kept as the fallback (``DSEC_LAZY_SERVER=daemon``): both serve the same tree;
with passthrough an opened file is read from a backing file the daemon never sees again."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.run.lazy import served_by

from .conftest import Published, read_all, stats
from .test_mount import assert_same_layer


def _server(m: Any) -> str:
    return json.loads((m.state / "config.json").read_text())["server"]  # type: ignore[no-any-return]


def test_this_kernel_serves_lazy_reads_by_passthrough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    assert served_by() == "kernel passthrough"  # kernel >= 6.9 with CONFIG_FUSE_PASSTHROUGH
    monkeypatch.setenv("DSEC_LAZY_SERVER", "daemon")
    assert served_by() == "fuse daemon"
    from dsec_cli.core.errors import UsageError

    monkeypatch.setenv("DSEC_LAZY_SERVER", "sometimes")
    with pytest.raises(UsageError, match="DSEC_LAZY_SERVER"):
        served_by()


@pytest.mark.parametrize("server", ["kernel", "daemon"])
def test_both_servers_show_the_source_tree(server: str, s3_image: Published, mounter: Any,
                                           monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("DSEC_LAZY_SERVER", server)
    m = mounter(s3_image.url, s3_image.layer)
    assert _server(m) == server
    assert_same_layer(s3_image.tree, m.lower_dirs[0])
    assert bool(_backing(tmp_path)) == (server == "kernel")


def _backing(tmp_path: Path) -> list[Path]:
    """Backing files in the node's file cache beside the mounter's chunk cache."""
    root = tmp_path / "files"
    return [p for p in root.glob("??/*")] if root.is_dir() else []


def test_opened_file_is_read_from_its_backing_file(s3_image: Published, mounter: Any,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    assert _server(m) == "kernel"
    path = m.lower_dirs[0] / "big/blob1.bin"
    want = (s3_image.tree / "big/blob1.bin").read_bytes()
    assert read_all(path) == want
    backing = [p for p in _backing(tmp_path) if p.stat().st_size == len(want)]
    assert [p.read_bytes() == want for p in backing] == [True]
    first = stats(m)
    for _ in range(3):  # new opens, reads and an mmap: none reaches the daemon
        assert read_all(path) == want
        import mmap

        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:4096] == want[:4096] and mm[-10:] == want[-10:]
    assert stats(m) == first


def test_backing_files_are_shared_and_checked(s3_image: Published, mounter: Any,
                                              monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    want = (s3_image.tree / "big/blob2.bin").read_bytes()
    m1 = mounter(s3_image.url, s3_image.layer)
    assert read_all(m1.lower_dirs[0] / "big/blob2.bin") == want
    [backing] = [p for p in _backing(tmp_path) if p.stat().st_size == len(want)]
    m2 = mounter(s3_image.url, s3_image.layer)  # a second mount on the node: nothing to fetch
    assert read_all(m2.lower_dirs[0] / "big/blob2.bin") == want
    s2 = stats(m2)
    assert s2["requests"] == 0 and s2["bytes_from_cache"] == 0 and s2["bytes_served"] == 0
    with open(backing, "r+b") as f:  # damage the cached file: it is not served again
        f.seek(100)
        f.write(b"\xff" * 64)
    m3 = mounter(s3_image.url, s3_image.layer)
    assert read_all(m3.lower_dirs[0] / "big/blob2.bin") == want
    assert stats(m3)["bytes_served"] == len(want)


def test_small_files_bring_their_pack_neighbours(s3_image: Published, mounter: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    data = m.lower_dirs[0] / "data"
    names = sorted(p.name for p in (s3_image.tree / "data").glob("file*.txt"))
    assert len(names) > 10
    assert read_all(data / names[0]) == (s3_image.tree / "data" / names[0]).read_bytes()
    first = stats(m)["requests"]
    assert first >= 1
    for n in names[1:]:  # stored after the first: they came with it
        assert read_all(data / n) == (s3_image.tree / "data" / n).read_bytes()
    assert stats(m)["requests"] == first


def test_kill9_of_kernel_server_leaves_nothing(s3_image: Published, mounter: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_cli.run.lazy import cleanup

    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    assert read_all(m.lower_dirs[0] / "etc/small.conf")
    os.kill(m.pid, signal.SIGKILL)
    os.waitpid(m.pid, 0)  # the daemon is this process's child here: reap it
    with pytest.raises(OSError):  # the connection is gone: ENOTCONN, never a hang
        read_all(m.lower_dirs[0] / "big/blob0.bin")
    cleanup(m.state)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(m.mountpoint) not in mounts and not Path(f"/proc/{m.pid}").exists()


def test_partial_backing_files_of_a_dead_server_are_swept(
        s3_image: Published, mounter: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    assert read_all(m.lower_dirs[0] / "etc/small.conf")
    tmp = tmp_path / "files" / "tmp"
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid that no longer runs
    stale = tmp / f"{'ab' * 16}.{dead}.1"
    stale.write_bytes(b"half a file")
    mine = tmp / f"{'cd' * 16}.{os.getpid()}.1"  # a live process's file is kept
    mine.write_bytes(b"in progress")
    mounter(s3_image.url, s3_image.layer)  # a new server on the node sweeps at start
    assert not stale.exists() and mine.exists()
