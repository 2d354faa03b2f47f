"""Hostile trees: crafted indexes, archives and sandbox diffs must never make dsec create,
link or change anything outside the directory it writes a layer into.

Every symlink these tests plant points at a sentinel directory the test made itself, and
every escape check looks at that directory and at the temp parent of the tree's root, so a
writer without the wall harms nothing but the test's own temp dirs."""

from __future__ import annotations

import io
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.build.layer import build_layer_from_dir, layer_manifest
from dsec_cli.build.tarball import read_tar
from dsec_cli.core.errors import FormatError, SpecError
from dsec_cli.format import tree as tree_mod
from dsec_cli.format.index import Entry, LayerIndex
from dsec_cli.format.refs import set_ref
from dsec_cli.format.tree import TreeWriter
from dsec_cli.push.dedup import KnownChunks, load_index
from dsec_cli.push.stores import open_store
from tests.treecmp import assert_same_tree

REPO = Path(__file__).resolve().parents[2]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways of resolving a parent beneath the root: openat2, and the O_NOFOLLOW walk a
    kernel without openat2 gets."""
    monkeypatch.setattr(tree_mod, "use_openat2", request.param == "openat2", raising=False)
    yield str(request.param)
    # the writer turns openat2 off for good when the kernel refuses it: then the "openat2"
    # case would have tested the walk
    assert tree_mod.use_openat2 == (request.param == "openat2")


@pytest.fixture
def arena(tmp_path: Path) -> tuple[Path, Path]:
    """(root, sentinel): the root alone in its temp parent; the sentinel dir elsewhere."""
    parent = tmp_path / "parent"
    parent.mkdir()
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    return parent / "root", sentinel


def assert_contained(root: Path, sentinel: Path) -> None:
    assert os.listdir(root.parent) == [root.name], os.listdir(root.parent)
    assert os.listdir(sentinel) == [], os.listdir(sentinel)


def apply(root: Path, entries: list[Entry], overlay_form: bool = False) -> list[str]:
    """Write the entries one by one; return the errors (the writer may refuse some)."""
    errors = []
    w = TreeWriter(root, overlay_form=overlay_form)
    try:
        for e in entries:
            try:
                w.write(e, [f"bytes of {e.path}\n".encode()] if e.type == "reg" else None)
            except FormatError as err:
                errors.append(str(err))
        w.finish()
    finally:
        w.close()  # idempotent after finish
    return errors


def D(p: str, mode: int = 0o755) -> Entry:  # noqa: N802
    return Entry(p, "dir", mode)


def F(p: str, mode: int = 0o644) -> Entry:  # noqa: N802
    return Entry(p, "reg", mode)


def S(p: str, target: str) -> Entry:  # noqa: N802
    return Entry(p, "sym", target=target)


def H(p: str, target: str) -> Entry:  # noqa: N802
    return Entry(p, "hard", target=target)


# -- the writer, entry orders -------------------------------------------------------------------

def test_dir_then_symlink_then_file_below(arena: tuple[Path, Path], resolver: str) -> None:
    root, sentinel = arena
    errors = apply(root, [D("."), D("a"), S("a", str(sentinel)), F("a/pwned")])
    assert len(errors) == 1 and "a" in errors[0]
    assert os.readlink(root / "a") == str(sentinel)  # the symlink won, as the later entry
    assert_contained(root, sentinel)


def test_deep_parent_replaced_by_symlink(arena: tuple[Path, Path], resolver: str) -> None:
    root, sentinel = arena
    errors = apply(root, [D("."), D("a"), D("a/b"), F("a/b/x"), S("a", str(sentinel)),
                          D("a/b"), F("a/b/y")])
    assert len(errors) == 2
    assert_contained(root, sentinel)


def test_replacements_last_wins(tmp_path: Path, resolver: str) -> None:
    """Later entries replace earlier ones, whatever the kinds: file -> dir, symlink -> dir,
    duplicates, and a directory replaced by a file, which loses its children and its pending
    metadata (before, the directory's mode was applied to the file at the end)."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    root = tmp_path / "root"
    assert apply(root, [D("."), F("a"), D("a", 0o750), F("a/x"),
                        S("b", str(sentinel)), D("b"), F("b/x"),
                        F("f", 0o600), F("f", 0o640), S("s", "one"), S("s", "two"),
                        D("d", 0o755), F("d/x"), F("d", 0o600)]) == []
    assert stat.S_IMODE(os.lstat(root / "a").st_mode) == 0o750
    assert (root / "a/x").read_bytes() == b"bytes of a/x\n"
    assert (root / "b").is_dir() and not (root / "b").is_symlink() and (root / "b/x").is_file()
    assert stat.S_IMODE(os.lstat(root / "f").st_mode) == 0o640
    assert os.readlink(root / "s") == "two"
    st = os.lstat(root / "d")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert os.listdir(sentinel) == []


def test_hardlinks_resolve_beneath_the_root(arena: tuple[Path, Path], resolver: str) -> None:
    """A hardlink's target is resolved like a parent: one whose path crosses a symlink of
    the tree (which linked an outside file in, to be exported or written through), an
    absolute one and one climbing with `..` are refused."""
    root, sentinel = arena
    victim_dir = root.parent.parent / "victim"
    victim_dir.mkdir()
    (victim_dir / "secret").write_bytes(b"host secret")
    targets = ["a/secret", "/etc/passwd", "../victim/secret", "d/../../victim/secret", ""]
    errors = apply(root, [D("."), S("a", str(victim_dir)), D("d"),
                          *[H(f"h{i}", t) for i, t in enumerate(targets)]])
    assert len(errors) == len(targets), errors
    assert sorted(os.listdir(root)) == ["a", "d"]
    assert os.lstat(victim_dir / "secret").st_nlink == 1
    assert_contained(root, sentinel)


def test_random_entry_sequences_stay_inside(tmp_path: Path, resolver: str) -> None:
    """Property: whatever the order, duplication and kinds of entries, nothing appears
    outside the root and the sentinel every symlink points at stays empty."""
    rnd = random.Random(20261201)
    names = ["a", "b", "a/b", "a/c", "b/a", "a/b/c", "a/b/c/d", "c"]
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    for case in range(150 if resolver == "openat2" else 60):
        parent = tmp_path / f"p{case}"
        parent.mkdir()
        root = parent / "root"
        entries = [D(".")]
        for _ in range(rnd.randint(3, 14)):
            p = rnd.choice(names)
            kind = rnd.choice(["dir", "dir", "reg", "sym", "sym", "hard", "fifo", "whiteout"])
            if kind == "dir":
                entries.append(D(p))
            elif kind == "reg":
                entries.append(F(p))
            elif kind == "sym":
                entries.append(S(p, rnd.choice([str(sentinel), "../../sentinel", "..", "/"])))
            elif kind == "hard":
                entries.append(H(p, rnd.choice(names)))
            else:
                entries.append(Entry(p, kind))
        apply(root, entries, overlay_form=rnd.random() < 0.5)
        assert os.listdir(parent) == ["root"], (case, entries)
        assert os.listdir(sentinel) == [], (case, entries)
        # the last entry written for each top-level name decides its kind
        for name in ("a", "b", "c"):
            last = [e for e in entries if e.path == name]
            if last and last[-1].type == "sym":
                assert (root / name).is_symlink(), (case, entries)


# -- the run path and the export path ----------------------------------------------------------

def _evil_store(tmp_path: Path, sentinel: Path) -> str:
    st = open_store(str(tmp_path / "store"))
    ix = LayerIndex(entries=[D("."), D("a"), S("a", str(sentinel)), F("a/pwned"),
                             D("bin")], chunks=[], packs=[])
    digest, _ = layer_manifest(st, ix, name="evil", version="1")
    set_ref(st, "evil", "1", digest)
    return (tmp_path / "store").as_uri()


@root_only
@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_crafted_index_on_the_run_path(tmp_path: Path, run_dsec, backend: str) -> None:  # type: ignore[no-untyped-def]
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    url = _evil_store(tmp_path, sentinel)
    p = run_dsec("run", "evil@1", "--backend", backend, "--", "/bin/true",
                 env={"DSEC_STORE": url}, check=False)
    assert p.returncode == 2, p.stderr  # hostile input
    # two walls: index validation refuses the duplicate path before the writer would refuse
    # to write below the link (the writer's own refusal is tested without validation above)
    assert ("refusing to write below 'a'" in p.stderr
            or "the path appears twice" in p.stderr), p.stderr
    assert "Traceback" not in p.stderr
    assert os.listdir(sentinel) == []
    # nothing half-written was left in the node's layer cache
    layers = Path(os.environ["DSEC_STATE_DIR"]) / "cache" / "layers"
    assert not layers.is_dir() or os.listdir(layers) == []


def test_crafted_index_on_the_export_path(tmp_path: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    """Export to a directory and to a tar: the tar must not carry a member below the
    layer's own symlink either (an extracting tar would follow it)."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    url = _evil_store(tmp_path, sentinel)
    for form in ("dir", "tar"):
        out = tmp_path / f"out-{form}" / ("x.tar" if form == "tar" else "x")
        out.parent.mkdir()
        p = run_dsec("export", "evil@1", str(out), env={"DSEC_STORE": url}, check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (form, p.stderr)
        assert "'a'" in p.stderr, p.stderr
        assert os.listdir(sentinel) == []
        assert os.listdir(out.parent) == []  # no partial export either


# -- archives ----------------------------------------------------------------------------------

def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return path


def _ti(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, link, 0o755 if kind == tarfile.DIRTYPE else 0o644
    return ti


_OUT_OF_ROOT = [
    ("/abs", "", tarfile.REGTYPE),
    ("../up", "", tarfile.REGTYPE),
    ("ok/../../up", "", tarfile.REGTYPE),
    ("h", "../outside", tarfile.LNKTYPE),
    ("h", "/etc/passwd", tarfile.LNKTYPE),
    ("s", "../../..", tarfile.SYMTYPE),
]


def test_archive_members_cannot_land_outside(tmp_path: Path) -> None:
    """A member through the archive's own symlink (or below its own file), a hardlink
    through a symlink or to itself, absolute paths and `..`: each archive is refused."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    archives: list[list[tuple[tarfile.TarInfo, bytes | None]]] = [
        [(_ti("d", tarfile.DIRTYPE), None), (_ti("d", tarfile.SYMTYPE, str(sentinel)), None),
         (_ti("d/pwned"), b"x")],
        [(_ti("f"), b"x"), (_ti("f/below"), b"y")],
        [(_ti("l", tarfile.SYMTYPE, "/etc"), None), (_ti("h", tarfile.LNKTYPE, "l/passwd"),
                                                     None)],
        [(_ti("f"), b"x"), (_ti("f", tarfile.LNKTYPE, "f"), None)],
        *[[(_ti(name, kind, link), b"x" if kind == tarfile.REGTYPE else None)]
          for name, link, kind in _OUT_OF_ROOT],
    ]
    for n, members in enumerate(archives):
        tar = _tar(tmp_path / f"evil-{n}.tar", members)
        with pytest.raises(SpecError):
            read_tar(tar, "/", tmp_path / f"spool-{n}")
    assert os.listdir(sentinel) == []


def test_archive_later_member_replaces_earlier(tmp_path: Path) -> None:
    """Last wins, as the writer applies it: a directory replaced by a file drops what was
    below it."""
    tar = _tar(tmp_path / "a.tar", [(_ti("d", tarfile.DIRTYPE), None), (_ti("d/x"), b"1"),
                                    (_ti("d"), b"2")])
    paths = {s.entry.path: s.entry.type for s in read_tar(tar, "/", tmp_path / "spool")}
    assert paths == {"d": "reg"}


def _sparse_tar(tmp_path: Path, apparent: int) -> Path:
    src = tmp_path / "sparse-src"
    src.mkdir(exist_ok=True)
    f = src / "big"
    with open(f, "wb") as fh:
        fh.seek(apparent // 2)
        fh.write(b"DATA" * 1024)
        fh.truncate(apparent)
    tar = tmp_path / f"sparse-{apparent}.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tar), "-C", str(src), "big"],
                   check=True)
    f.unlink()
    return tar


def test_archive_sparse_member_spools_what_it_holds(tmp_path: Path) -> None:
    """A 2 GB sparse member: the spool holds its data, not 2 GB of zeros."""
    apparent = 2 << 30
    tar = _sparse_tar(tmp_path, apparent)
    assert tar.stat().st_size < 1 << 20
    scanned = read_tar(tar, "/", tmp_path / "spool")
    (s,) = [s for s in scanned if s.entry.path == "big"]
    assert s.entry.size == apparent and s.source is not None
    st = os.stat(s.source)
    assert st.st_size == apparent
    assert st.st_blocks * 512 < 1 << 20, st.st_blocks
    with open(s.source, "rb") as fh:
        fh.seek(apparent // 2)
        assert fh.read(8) == b"DATADATA"


def test_archive_sparse_member_size_is_bounded(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import dsec_cli.build.tarball as tb

    monkeypatch.setattr(tb, "MAX_SPARSE_SIZE", 1 << 30)
    tar = _sparse_tar(tmp_path, 2 << 30)
    with pytest.raises(SpecError, match="sparse"):
        read_tar(tar, "/", tmp_path / "spool")


def test_extract_step_with_crafted_archive(tmp_path: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    """End to end: a spec extracting an archive that plants a symlink and a member through
    it is refused at build time, with the archive named, and nothing lands outside."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    _tar(spec_dir / "evil.tar", [(_ti("etc", tarfile.SYMTYPE, str(sentinel)), None),
                                 (_ti("etc/pwned"), b"x")])
    (spec_dir / "evil.yaml").write_text(
        "layer: evil\nversion: '1'\nsteps:\n  - extract: {src: ./evil.tar, dst: /}\n")
    p = run_dsec("build", str(spec_dir / "evil.yaml"), "--store",
                 (tmp_path / "store").as_uri(), check=2)
    assert "evil.tar" in p.stderr and "below 'etc'" in p.stderr, p.stderr
    assert os.listdir(sentinel) == []


# -- snapshots ---------------------------------------------------------------------------------

@root_only
def test_snapshot_special_files(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    os.mknod(upper / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # overlay whiteout
    os.mknod(upper / "mem", stat.S_IFCHR | 0o600, os.makedev(1, 1))
    os.mknod(upper / "disk", stat.S_IFBLK | 0o600, os.makedev(8, 0))
    os.mkfifo(upper / "pipe")
    (upper / "suid").write_bytes(b"#!/bin/sh\n")
    os.chmod(upper / "suid", 0o6755)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "host-file").write_bytes(b"host")
    os.symlink(outside, upper / "link")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(upper / "sock"))
    sock.close()
    st = open_store(str(tmp_path / "store"))
    report = tree_mod.ScanReport()
    _, m = build_layer_from_dir(st, upper, "snap", "1",
                                known=KnownChunks.load(st, tmp_path / "tables"),
                                snapshot=report)
    ix = load_index(st, m.index or "")
    kinds = {e.path: e for e in ix.entries}
    assert kinds["gone"].type == "whiteout"
    assert kinds["pipe"].type == "fifo"
    assert kinds["link"].type == "sym"
    assert "link/host-file" not in kinds
    for dropped in ("mem", "disk", "sock"):
        assert dropped not in kinds
        assert any(d.startswith(dropped + ":") for d in report.dropped)
    assert kinds["suid"].mode == 0o755
    assert any(c.startswith("suid:") for c in report.changed)


# -- lazy filesystem ----------------------------------------------------------------------------

def test_lazy_fs_duplicates_and_children_of_links(tmp_path: Path) -> None:
    import errno

    from dsec_cli.run.lazy.fs import LazyFS

    ix = LayerIndex(entries=[D("."), D("a"), F("a/x"), S("a", "/tmp"), F("a/y"), F("b"),
                             F("b", 0o600), S("c", "t"), F("c/z"), H("h", "a/x")],
                    chunks=[], packs=[])
    latin = os.fsdecode(b"caf\xe9")  # what the kernel's bytes decode to in mfusepy
    ix.entries.append(S(latin, os.fsdecode(b"t\xff")))
    fs = LazyFS([ix], [])
    names = [n for n, _, _ in fs.readdir("/0", 0)]
    assert sorted(names) == sorted([".", "..", "a", "b", "c", latin])
    assert fs.getattr(f"/0/{latin}")["st_size"] == 2  # the target's length in bytes
    assert os.fsencode(fs.readlink(f"/0/{latin}")) == b"t\xff"
    assert stat.S_ISLNK(fs.getattr("/0/a")["st_mode"])
    assert fs.getattr("/0/b")["st_mode"] & 0o777 == 0o600
    for gone in ("/0/a/x", "/0/a/y", "/0/c/z", "/0/h"):
        with pytest.raises(OSError) as ei:
            fs.getattr(gone)
        assert ei.value.errno == errno.ENOENT


# -- non-UTF-8 names ---------------------------------------------------------------------------

def test_index_names_keep_utf8_docs_unchanged() -> None:
    assert Entry("caf\u00e9", "sym", target="x").to_doc()["p"] == "caf\u00e9"
    raw = os.fsdecode(b"caf\xe9")
    doc = Entry(raw, "sym", target=os.fsdecode(b"\xff/t")).to_doc()
    assert "p" not in doc and "l" not in doc and "pb" in doc and "lb" in doc
    back = Entry.from_doc(doc)
    assert os.fsencode(back.path) == b"caf\xe9" and os.fsencode(back.target) == b"\xff/t"
    with pytest.raises(FormatError):  # one spelling per name
        Entry.from_doc({"t": "reg", "pb": "YQ=="})
    with pytest.raises(FormatError):  # a JSON-escaped lone surrogate is not a name
        Entry.from_doc({"t": "reg", "p": "\udce9"})


@root_only
def test_non_utf8_names_build_and_export_exactly(tmp_path: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "spec" / "files"
    src.mkdir(parents=True)
    bsrc = os.fsencode(src)
    os.mkdir(bsrc + b"/dir-\xff")
    with open(bsrc + b"/caf\xe9", "wb") as f:
        f.write(b"latin-1 name\n")
    with open(bsrc + b"/dir-\xff/inner", "wb") as f:
        f.write(b"inner\n")
    os.symlink(b"target-\xfe\xe9", bsrc + b"/link")
    os.symlink(b"caf\xe9", bsrc + b"/link-\x80")
    (tmp_path / "spec" / "names.yaml").write_text(
        "layer: names\nversion: '1'\nsteps:\n  - copy: {src: ./files, dst: /, keep_mtime: true}\n")
    url = (tmp_path / "store").as_uri()
    run_dsec("build", str(tmp_path / "spec" / "names.yaml"), "--store", url)
    out = tmp_path / "out"
    run_dsec("export", "names@1", str(out), "--store", url)
    assert sorted(os.listdir(os.fsencode(out))) == sorted(os.listdir(bsrc))
    assert os.readlink(os.fsencode(out) + b"/link") == b"target-\xfe\xe9"
    assert os.readlink(os.fsencode(out) + b"/link-\x80") == b"caf\xe9"
    assert_same_tree(src, out, root_meta=False)
    run_dsec("export", "names@1", str(tmp_path / "out.tar"), "--store", url)
    with tarfile.open(tmp_path / "out.tar", errors="surrogateescape") as tf:
        members = {os.fsencode(m.name): m for m in tf.getmembers()}
    assert b"./caf\xe9" in members and b"./dir-\xff/inner" in members
    assert os.fsencode(members[b"./link"].linkname) == b"target-\xfe\xe9"
    # GNU tar (what a user would extract with) reads the same bytes
    x = tmp_path / "x"
    x.mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "out.tar"), "-C", str(x)], check=True)
    assert_same_tree(src, x, root_meta=False)


# -- a build killed during a run step ----------------------------------------------------------

def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(str(path))]


@pytest.fixture
def busybox_store(tmp_path: Path, busybox_tar: Path, run_dsec) -> Iterator[str]:  # type: ignore[no-untyped-def]
    url = (tmp_path / "store").as_uri()
    run_dsec("build", str(REPO / "layerspecs/busybox/busybox.yaml"), "--store", url)
    yield url


@root_only
def test_killed_build_is_cleaned_by_node_gc(tmp_path: Path, busybox_store: str,
                                            dsec_home: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "spec" / "slow.yaml"
    spec.parent.mkdir()
    spec.write_text("layer: slow\nversion: '1'\nfrom: [busybox@1.35-1]\n"
                    "steps:\n  - run: 'echo started; sleep 60'\n")
    tmp_root = dsec_home / "data" / "dsec" / "tmp"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from dsec_cli.cli import main; main()", "build", str(spec),
         "--store", busybox_store], cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _mounts_under(tmp_root):
            assert proc.poll() is None, "the build ended before its run step"
            assert time.monotonic() < deadline, "the run step's overlay never appeared"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)  # bwrap --die-with-parent follows its parent
    # the leak the kill leaves: a mounted overlay and the staging dir
    assert _mounts_under(tmp_root)
    assert [p.name for p in tmp_root.iterdir() if p.name.startswith("build-")]
    try:
        p = run_dsec("gc", "--node", "--json")
        assert "stale_builds" in p.stdout
        assert _mounts_under(tmp_root) == []
        assert [p.name for p in tmp_root.iterdir() if p.name.startswith("build-")] == []
    finally:  # where the cleanup is missing, the test still leaves no mount behind
        for point in sorted(_mounts_under(tmp_root), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False)


@root_only
def test_next_build_cleans_a_killed_builds_staging(tmp_path: Path, busybox_store: str,
                                                   dsec_home: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    """A staging dir whose owner is gone (pid reused or not) is removed by the next build;
    one whose owner still runs is left alone."""
    from dsec_cli.build.steps import OWNER_FILE, _start_time

    tmp_root = dsec_home / "data" / "dsec" / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    stale = tmp_root / "build-stale"
    (stale / "upper").mkdir(parents=True)
    (stale / OWNER_FILE).write_text(f'{{"pid": {os.getpid()}, "start": 1}}')
    live = tmp_root / "build-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(
        f'{{"pid": {os.getpid()}, "start": {_start_time(os.getpid())}}}')
    spec = tmp_path / "spec" / "quick.yaml"
    spec.parent.mkdir()
    (spec.parent / "f").write_text("x")
    spec.write_text("layer: quick\nversion: '1'\nsteps:\n  - copy: {src: ./f, dst: /f}\n")
    run_dsec("build", str(spec), "--store", busybox_store)
    assert not stale.exists()
    assert live.is_dir()
