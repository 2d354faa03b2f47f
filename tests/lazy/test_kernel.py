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

from dsec_cli.push.stores import open_store
from dsec_cli.run.lazy import served_by

from .conftest import Published, read_all, stats
from .test_mount import _index, assert_same_layer


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


def _stats_reaching(m: Any, key: str, want: float) -> dict[str, float]:
    """The daemon's statistics once ``key`` has reached ``want`` (background work counts
    as it finishes: polled, generous deadline), settled."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if json.loads((m.state / "stats.json").read_text())[key] >= want:
            break
        time.sleep(0.1)
    return stats(m)


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
    first = stats(m)
    assert first["requests"] >= 1
    for n in names[1:]:  # stored after the first: they came with it, read without waiting
        assert read_all(data / n) == (s3_image.tree / "data" / n).read_bytes()
    assert stats(m)["stall_seconds"] == first["stall_seconds"]


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


def test_small_files_are_served_without_backing_files(s3_image: Published, mounter: Any,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """A file up to INLINE_FILE is answered from memory (no backing file is made for it);
    a larger one gets its backing file; both read back what was stored, mmap included."""
    import mmap

    from dsec_cli.run.lazy.readahead import INLINE_FILE

    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    small = s3_image.tree / "data/medium.bin"
    assert 0 < small.stat().st_size <= INLINE_FILE
    want = small.read_bytes()
    assert read_all(m.lower_dirs[0] / "data/medium.bin") == want
    with open(m.lower_dirs[0] / "data/medium.bin", "rb") as f, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[:] == want
    assert _backing(tmp_path) == []
    big = (s3_image.tree / "big/blob0.bin").read_bytes()
    assert len(big) > INLINE_FILE
    assert read_all(m.lower_dirs[0] / "big/blob0.bin") == big
    assert [p.stat().st_size for p in _backing(tmp_path)] == [len(big)]


def test_warm_walk_preloads_from_the_disk_cache_only(s3_image: Published, mounter: Any,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """On a warm node a small file's pack neighbours are read ahead from the chunk cache,
    never from the store: the walk fetches nothing, and bytes counted at its first read
    stay what that read and its preload took from the disk."""
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    names = sorted(p.name for p in (s3_image.tree / "data").glob("file*.txt"))
    m1 = mounter(s3_image.url, s3_image.layer)
    for n in names:  # fills the node's chunk cache (written behind, drained at unmount)
        assert read_all(m1.lower_dirs[0] / "data" / n)
    from dsec_cli.run.lazy import cleanup

    cleanup(m1.state)
    m2 = mounter(s3_image.url, s3_image.layer)
    first = m2.lower_dirs[0] / "data" / names[0]
    assert read_all(first) == (s3_image.tree / "data" / names[0]).read_bytes()
    ix = _index(s3_image.url, s3_image.layer)
    chunks = {ci for e in ix.entries if e.path.startswith("data/file") for ci, _, _ in e.chunks}
    assert len(chunks) > 1  # the files span several chunks: the first read needs only one
    with open_store(s3_image.url) as st:
        max_read = st.preferred_read_size
    own = [ci for ci, _, _ in ix.entries[[e.path for e in ix.entries].index(
        f"data/{names[0]}")].chunks]
    window = _window_after(ix, own, max_read)  # all in the cache: m1 fetched them
    assert chunks <= {*own, *window}
    s = _stats_reaching(m2, "bytes_from_cache", sum(ix.chunks[c].ulen for c in {*own, *window}))
    assert s["requests"] == 0 and s["bytes_fetched"] == 0
    assert s["bytes_from_cache"] == sum(ix.chunks[c].ulen for c in {*own, *window})
    for n in names:
        assert read_all(m2.lower_dirs[0] / "data" / n) == \
            (s3_image.tree / "data" / n).read_bytes()
    after = stats(m2)  # the rest came from memory: nothing more from the disk or the store
    assert (after["requests"], after["bytes_from_cache"]) == (0, s["bytes_from_cache"])


def test_concurrent_opens_of_one_file_make_one_verified_backing_file(
        s3_image: Published, mounter: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    want = (s3_image.tree / "big/blob1.bin").read_bytes()
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda _: read_all(m.lower_dirs[0] / "big/blob1.bin"), range(8)))
    assert all(g == want for g in got)
    backing = [p for p in _backing(tmp_path) if p.stat().st_size == len(want)]
    assert [p.read_bytes() == want for p in backing] == [True]
    assert list((tmp_path / "files" / "tmp").iterdir()) == []  # no half-made copy left


def test_kill9_while_fetching_and_writing_behind_leaves_nothing(
        s3_image: Published, mounter: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """kill -9 of the server in the middle of a walk (chunks fetched, queued for the chunk
    cache's writer, backing files being made): cleanup leaves no mount and no process, a new
    server sweeps the dead one's partial files, and every file still reads back verified."""
    import threading

    from dsec_cli.run.lazy import cleanup

    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    files = sorted(p.relative_to(s3_image.tree) for p in s3_image.tree.rglob("*")
                   if p.is_file() and not p.is_symlink())
    m = mounter(s3_image.url, s3_image.layer)
    started = threading.Event()

    def walk() -> None:
        for rel in files:
            started.set()
            try:
                read_all(m.lower_dirs[0] / rel)
            except OSError:
                return  # the server is gone: ENOTCONN
    t = threading.Thread(target=walk)
    t.start()
    assert started.wait(30)
    os.kill(m.pid, signal.SIGKILL)
    os.waitpid(m.pid, 0)
    t.join(30)
    assert not t.is_alive()
    stale = tmp_path / "chunks" / "tmp" / f"{'ef' * 16}.{m.pid}.dead"  # as a torn write
    stale.write_bytes(b"half a chunk")
    cleanup(m.state)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(m.mountpoint) not in mounts and not Path(f"/proc/{m.pid}").exists()
    m2 = mounter(s3_image.url, s3_image.layer)
    assert not stale.exists()
    for rel in files:
        assert read_all(m2.lower_dirs[0] / rel) == (s3_image.tree / rel).read_bytes(), rel


def _window_after(ix: Any, own: list[int], max_read: int) -> list[int]:
    """The chunks stored after ``own`` in pack order, up to one preferred read (as the
    server's read-ahead window)."""
    seq = sorted(range(len(ix.chunks)), key=lambda i: (ix.chunks[i].pack, ix.chunks[i].offset))
    start = max(seq.index(c) for c in own) + 1
    out, budget, pack, end = [], max_read, -1, 0
    for ci in seq[start:]:
        loc = ix.chunks[ci]  # a chunk group's members overlap: each adds what it extends
        more = loc.offset + loc.clen - end if loc.pack == pack and loc.offset < end else loc.clen
        budget -= max(more, 0)
        if budget < 0:
            break
        out.append(ci)
        end = max(end, loc.offset + loc.clen) if loc.pack == pack else loc.offset + loc.clen
        pack = loc.pack
    return out


def test_read_ahead_starts_only_with_a_sequential_read(s3_image: Published, mounter: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One small file read (as a first exec reads) fetches its chunks and one window after
    them, nothing more, however long one waits; reading a file of that window (a walk) loads
    the next window in the background, and that read waits for no fetch."""
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    ix = _index(s3_image.url, s3_image.layer)
    max_read = 32 << 10  # small windows: the layer spans many
    small = [e for e in ix.entries if e.type == "reg" and 0 < e.size <= 64 << 10]
    for e in small:  # a first file, a second one stored in its window, and more after
        own = [ci for ci, _, _ in e.chunks]
        window = _window_after(ix, own, max_read)
        nxt = [f for f in small if f is not e and all(ci in window for ci, _, _ in f.chunks)]
        after = _window_after(ix, [window[-1]], max_read) if window else []
        if nxt and after:
            break
    else:
        raise AssertionError("no file of the test layer has a neighbour and a window after")
    m = mounter(s3_image.url, s3_image.layer, max_read=max_read)
    assert read_all(m.lower_dirs[0] / e.path) == (s3_image.tree / e.path).read_bytes()
    first = stats(m)  # settled: nothing more arrives while nobody reads
    assert first["bytes_fetched"] == sum(ix.chunks[c].clen for c in {*own, *window})
    f = nxt[0]
    assert read_all(m.lower_dirs[0] / f.path) == (s3_image.tree / f.path).read_bytes()
    want = first["bytes_fetched"] + sum(ix.chunks[c].clen for c in after)
    s = _stats_reaching(m, "bytes_fetched", want)
    assert s["stall_seconds"] == first["stall_seconds"]  # it was in memory already
    assert s["bytes_fetched"] == want


def _loop_counters(m: Any) -> dict[str, Any]:
    """The compiled loop's counters (loop.json, written when they change), once settled."""
    import time

    deadline = time.monotonic() + 60
    last = None
    while time.monotonic() < deadline:
        path = m.state / "loop.json"
        if not path.exists():  # the mount's first write of them is a tick away
            time.sleep(0.2)
            continue
        doc = json.loads(path.read_text())
        if doc == last:
            return doc  # type: ignore[no-any-return]
        last = doc
        time.sleep(0.7)
    raise AssertionError(f"the compiled loop's counters did not settle within 60 s: {last}")


def _walk_and_compare(tree: Path, lower: Path) -> list[Path]:
    """Read every regular file twice (the second time with the mount's page cache dropped,
    so the reads reach the server again); each read equals the source tree's bytes."""
    files = sorted(p.relative_to(tree) for p in tree.rglob("*")
                   if p.is_file() and not p.is_symlink())
    for rel in files:
        assert read_all(lower / rel) == (tree / rel).read_bytes(), rel
    for rel in files:
        with open(lower / rel, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    for rel in files:
        assert read_all(lower / rel) == (tree / rel).read_bytes(), rel
    return files


def test_compiled_loop_answers_the_hot_requests_of_a_walk(
        s3_image: Published, mounter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk that lists and reads every file is answered mostly by the compiled loop
    (opens, small files' reads from verified bytes handed over, releases, listings), with
    the same bytes as the source; the bytes it served are counted, and every file it
    opened is in the access profile."""
    from dsec_cli.run.lazy.fuseproto import LOOKUP, OPEN, READ, READDIRPLUS, RELEASE

    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    monkeypatch.delenv("DSEC_PY_FUSELOOP", raising=False)
    m = mounter(s3_image.url, s3_image.layer)
    assert _server(m) == "kernel"
    files = _walk_and_compare(s3_image.tree, m.lower_dirs[0])
    assert_same_layer(s3_image.tree, m.lower_dirs[0])  # listings and lookups too
    c = _loop_counters(m)
    by_op = {int(k): v for k, v in c["by_op"].items()}
    assert c["answered"] >= 3 * len(files), c
    assert by_op.get(OPEN, 0) >= len(files) and by_op.get(RELEASE, 0) >= len(files), c
    assert by_op.get(READ, 0) > 0 and c["bytes_served"] > 0, c
    assert by_op.get(READDIRPLUS, 0) + by_op.get(LOOKUP, 0) > 0, c
    assert stats(m)["bytes_served"] >= c["bytes_served"]
    import time

    # (a hard link is profiled under its group's first member, as by the Python loop)
    want = {str(f) for f in files if (s3_image.tree / f).stat().st_nlink == 1}
    deadline = time.monotonic() + 30
    profiled: set[str] = set()
    while time.monotonic() < deadline and not want <= profiled:
        time.sleep(0.2)
        doc = json.loads((m.state / "profile.json").read_text())
        profiled = {p for p, _ in doc["layers"][0]["files"]}
    assert want <= profiled


def test_python_loop_serves_the_same_without_the_extension(
        s3_image: Published, mounter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSEC_PY_FUSELOOP (as a build without the compiled loop): every request is answered
    by the Python loop, with the same bytes and tree."""
    monkeypatch.delenv("DSEC_LAZY_SERVER", raising=False)
    monkeypatch.setenv("DSEC_PY_FUSELOOP", "1")
    m = mounter(s3_image.url, s3_image.layer)
    assert _server(m) == "kernel"
    _walk_and_compare(s3_image.tree, m.lower_dirs[0])
    assert_same_layer(s3_image.tree, m.lower_dirs[0])
    assert stats(m)["bytes_served"] > 0
    assert json.loads((m.state / "loop.json").read_text()) == {}  # no compiled loop ran
