"""The compiled walker and batched reader (format/_walk.c) give exactly what their pure-Python
twins give: the same records, the same scans and byte-identical layers (index, packs, content
digest). The extension is compiled here from its source, so the source in the tree is what is
tested whether or not the package build has built it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from dsec_cli.build import layer
from dsec_cli.build.layer import write_layer
from dsec_cli.core.digests import object_key
from dsec_cli.format import tree
from dsec_cli.format.index import ChunkParams, put_index
from dsec_cli.format.tree import ScanReport, scan_dir
from dsec_cli.push.dedup import KnownChunks
from dsec_cli.push.stores import open_store
from tests.cext import build_and_load

from .conftest import make_tree

SRC = Path(tree.__file__).with_name("_walk.c")


@pytest.fixture(scope="module")
def cwalk(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return build_and_load(SRC, tmp_path_factory.mktemp("walk"))


@pytest.fixture
def compiled(cwalk: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setattr(tree, "_cwalk", cwalk)
    monkeypatch.setattr(tree, "use_compiled", True)
    return cwalk


def _hostile_tree(root: Path) -> Path:
    """make_tree plus names that sort differently as bytes and as text, names that are not
    UTF-8, an overlay whiteout, an opaque directory, a socket, and a wide directory."""
    make_tree(root)
    b = os.fsencode(root)
    for name in (b"caf\xc3\xa9", b"caf\xe9", b"Zeta", b"alpha", b"\xff\xfe", b"a b", b"a-b",
                 b"\xe2\x82\xac", b"\xed\xb2\x80", b"\xee\x80\x80", b"\xf0"):
        with open(b + b"/data/" + name, "wb") as f:
            f.write(name * 3)
    (root / "wide").mkdir()
    for i in range(600):  # more than one read batch of small files
        (root / f"wide/f{i:04d}").write_bytes(os.urandom(i % 50) + b"x" * (i * 37 % 20_000))
    (root / "wide/sub").mkdir()
    os.mknod(root / "wide/gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    (root / "opaque").mkdir()
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    os.setxattr(root / "opaque", "user.kept", b"v")
    (root / "opaque/in").write_text("in\n")
    import socket

    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(root / "data/sock"))
    finally:
        s.close()
    return root


def test_records_match_python_walk(tmp_path: Path, compiled: ModuleType) -> None:
    root = _hostile_tree(tmp_path / "src")
    for xattrs in (True, False):
        got = compiled.scan(str(root), xattrs)
        want = tree._py_records(str(root), xattrs)
        assert [r[0] for r in got] == [r[0] for r in want]
        assert got == want
    assert any(r[0].startswith("data/caf") for r in got)
    assert len(got) > 650


@pytest.mark.parametrize("kind", ["plain", "overlay", "snapshot"])
def test_scans_match(tmp_path: Path, cwalk: ModuleType, monkeypatch: pytest.MonkeyPatch,
                     kind: str) -> None:
    root = _hostile_tree(tmp_path / "src")
    scans = []
    reports = []
    for use in (True, False):
        monkeypatch.setattr(tree, "_cwalk", cwalk)
        monkeypatch.setattr(tree, "use_compiled", use)
        report = ScanReport() if kind == "snapshot" else None
        scans.append(scan_dir(root, overlay_upper=kind != "plain", snapshot=report))
        reports.append(report)
    assert scans[0] == scans[1]
    assert reports[0] == reports[1]
    types = {s.entry.path: s.entry.type for s in scans[0]}
    if kind != "plain":
        assert types["wide/gone"] == "whiteout"
        assert next(s.entry for s in scans[0] if s.entry.path == "opaque").opaque
    assert "data/sock" not in types


def test_read_many_matches_python(tmp_path: Path, compiled: ModuleType) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "small").write_bytes(b"abc")
    (tmp_path / "big").write_bytes(b"z" * 5000)
    paths = [str(tmp_path / n) for n in ("empty", "small", "big", "small")]
    got = compiled.read_many(paths, 4096)
    assert got == tree._py_read_many(paths, 4096)
    assert got == [(0, None), (3, b"abc"), (5000, None), (3, b"abc")]
    with pytest.raises(FileNotFoundError):
        compiled.read_many([str(tmp_path / "small"), str(tmp_path / "missing")], 4096)


def _layer(tmp_path: Path, root: Path, name: str, params: ChunkParams) -> tuple[str, dict]:
    store = open_store(str(tmp_path / name))
    known = KnownChunks.load(store, tmp_path / f"{name}-tables")
    index, stats = write_layer(store, scan_dir(root), known=known, params=params)
    digest = put_index(store, index)
    packs = {p: store.get(object_key("packs", p)) for p in stats.packs_written}
    return digest, {"content": index.content_digest(), "packs": packs}


def test_layers_are_byte_identical(tmp_path: Path, cwalk: ModuleType,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = _hostile_tree(tmp_path / "src")
    # small batches and chunk sizes: many read batches, files cut by the chunker
    monkeypatch.setattr(layer, "READ_BATCH_FILES", 7)
    monkeypatch.setattr(layer, "READ_BATCH_BYTES", 50_000)
    params = ChunkParams(min_size=4096, avg_size=16384, max_size=65536, small_file=4096)
    monkeypatch.setattr(tree, "_cwalk", cwalk)
    monkeypatch.setattr(tree, "use_compiled", True)
    fast = _layer(tmp_path, root, "fast", params)
    monkeypatch.setattr(tree, "use_compiled", False)
    slow = _layer(tmp_path, root, "slow", params)
    assert fast == slow
    assert len(fast[1]["packs"]) >= 1


def test_a_vanished_file_fails_the_layer_cleanly(tmp_path: Path, compiled: ModuleType) -> None:
    root = _hostile_tree(tmp_path / "src")
    scanned = scan_dir(root)
    (root / "wide/f0300").unlink()
    store = open_store(str(tmp_path / "store"))
    with pytest.raises(FileNotFoundError):
        write_layer(store, scanned, known=KnownChunks.load(store, tmp_path / "t"))
    assert not list((tmp_path / "store").rglob("packs/*/*"))
    shutil.rmtree(root)


def test_grouped_compression_is_deterministic_and_keeps_the_content_digest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """New chunks are compressed in groups (format/codec.py): the same tree gives the same
    packs and index every time (packs sealed mid-stream here), and the content digest is
    that of the same tree stored one chunk per frame."""
    root = _hostile_tree(tmp_path / "src")
    params = ChunkParams(min_size=4096, avg_size=16384, max_size=65536, small_file=4096)
    monkeypatch.setattr(layer, "PACK_TARGET", 100_000)
    monkeypatch.setattr(layer, "GROUP_CHUNKS", 1)
    one = _layer(tmp_path, root, "one", params)
    monkeypatch.setattr(layer, "GROUP_CHUNKS", 32)
    monkeypatch.setattr(layer, "GROUP_BYTES", 300_000)
    grouped = _layer(tmp_path, root, "grouped", params)
    again = _layer(tmp_path, root, "again", params)
    assert grouped == again
    assert one[1]["content"] == grouped[1]["content"]
    assert one[0] != grouped[0]  # the stored form differs: groups share frames
    assert len(grouped[1]["packs"]) >= 3


def test_a_bottomless_tree_is_a_recursion_error(tmp_path: Path, compiled: ModuleType) -> None:
    """A tree nested deeper than Python's recursion limit stops both walks with
    RecursionError (the compiled one counts its levels against the same limit), never with
    a stack overflow."""
    root = tmp_path / "deep"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1200):  # os.makedirs would itself recurse too deep
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    try:
        with pytest.raises(RecursionError):
            compiled.scan(str(root), True)
        with pytest.raises(RecursionError):
            tree._py_records(str(root), True)
        for listing in (compiled.stat_listing, tree._py_stat_listing):
            with pytest.raises(RecursionError):
                listing(str(root))
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_stat_listing_matches_python(tmp_path: Path, compiled: ModuleType) -> None:
    """The build cache's input listing: the same bytes from C and from Python, for a tree,
    a single file and a symlinked root; a missing root is FileNotFoundError in both."""
    root = _hostile_tree(tmp_path / "src")
    os.symlink(root, tmp_path / "link")
    for top in (root, root / "data/medium.bin", tmp_path / "link"):
        got = compiled.stat_listing(str(top))
        assert got == tree._py_stat_listing(str(top))
    lines = compiled.stat_listing(str(root)).split(b"\n")[:-1]
    rels = [ln.split(b"\0")[0] for ln in lines]
    assert rels[0] == b"." and b"data/caf\xe9" in rels and b"wide/f0599" in rels
    assert len(rels) == len(compiled.scan(str(root), False))
    for fn in (compiled.stat_listing, tree._py_stat_listing):
        with pytest.raises(FileNotFoundError):
            fn(str(tmp_path / "missing"))


@pytest.mark.parametrize("use", [True, False])
def test_scan_entries_keep_every_kind_and_the_snapshot_policy(
        tmp_path: Path, cwalk: ModuleType, monkeypatch: pytest.MonkeyPatch, use: bool) -> None:
    """What scan_dir makes of each kind of path (with either walk): modes, owners, mtimes,
    sizes, targets, devices and xattrs as on disk; in a snapshot, setuid bits and file
    capabilities are removed and device nodes and sockets dropped, each one reported."""
    monkeypatch.setattr(tree, "_cwalk", cwalk)
    monkeypatch.setattr(tree, "use_compiled", use)
    root = _hostile_tree(tmp_path / "src")
    import struct

    # VFS_CAP_REVISION_2 with cap_net_bind_service permitted
    os.setxattr(root / "bin/tool", "security.capability",
                struct.pack("<5I", 0x02000000, 1 << 10, 0, 0, 0))
    plain = {s.entry.path: s for s in scan_dir(root)}
    tool = plain["bin/tool"].entry
    st = os.lstat(root / "bin/tool")
    assert (tool.type, tool.mode, tool.uid, tool.gid, tool.mtime, tool.size) == (
        "reg", 0o4755, 1234, 5678, st.st_mtime_ns, st.st_size)
    assert plain["bin/tool"].source == str(root / "bin/tool")
    assert "security.capability" in tool.xattrs
    assert plain["data/null"].entry.type == "chr" and plain["data/null"].entry.rdev == (1, 3)
    assert plain["data/rel-link"].entry.target == "../etc/small.conf"
    assert plain["data/fifo"].entry.type == "fifo"
    assert plain["etc/small.conf"].entry.xattrs == {"user.dsec.test": b"\x00binary\xff"}
    assert plain["opaque"].entry.xattrs == {"user.kept": b"v"}
    assert not plain["opaque"].entry.opaque  # only overlay scans read the marker
    assert {plain["data/hard-a"].entry.type, plain["data/medium.bin"].entry.type} == {
        "reg", "hard"}
    report = ScanReport()
    snap = {s.entry.path: s.entry for s in scan_dir(root, overlay_upper=True,
                                                    snapshot=report)}
    assert snap["bin/tool"].mode == 0o755 and "security.capability" not in snap["bin/tool"].xattrs
    assert "data/null" not in snap and "data/sock" not in snap
    assert snap["wide/gone"].type == "whiteout" and snap["opaque"].opaque
    assert "bin/tool: setuid/setgid bits removed" in report.changed
    assert "bin/tool: file capabilities removed" in report.changed
    assert "data/null: device node" in report.dropped and "data/sock: socket" in report.dropped
