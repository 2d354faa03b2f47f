"""What a sandbox's tree or a store object costs a node is bounded.

Covered: trees a sandbox made thousands of levels deep (and deeper than PATH_MAX) are removed
by `dsec rm` and `dsec gc --node` without recursion; the removal never follows a symlink (a
canary dir of the test's own stays whole); a layer whose index names far more file bytes
than it stores (one chunk repeated) is refused before anything is written; and an index
bomb in a shared store is skipped by the dedup of other builds within a small bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.digests import chunk_id, put_object
from dsec_cli.core.files import remove_tree, tree_size
from dsec_cli.format.index import ChunkLoc, Entry, LayerIndex
from dsec_cli.format.manifest import Manifest, put_manifest
from dsec_cli.format.pack import HEADER
from dsec_cli.format.refs import get_ref, set_ref
from dsec_cli.push.stores import open_store
from tests.run.conftest import (  # noqa: F401  (fixtures)
    IMAGE,
    dsec,
    dsec_home,
    leaks,
    node_env,
    sandbox_data,
    store_url,
)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")
PEAK_RSS_CODE = ("import sys\nfrom dsec_cli.cli import main\ntry:\n    main()\nfinally:\n"
                 "    hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')]\n"
                 "    print('maxrss', int(hwm[0].split()[1]), file=sys.stderr)\n")


def _deep(root: Path, depth: int, name: str = "d") -> None:
    """A chain of `depth` directories below root, made through fds (no long paths)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)


# -- removal and walks without recursion -----------------------------------------------------
def test_remove_tree_5000_deep(tmp_path: Path) -> None:
    """5,000 levels of 40-byte names: 200 KB of path, far past PATH_MAX and the recursion
    limit."""
    t = tmp_path / "t"
    t.mkdir()
    _deep(t, 5000, "n" * 40)
    assert tree_size(t) == 0
    remove_tree(t)
    assert list(tmp_path.iterdir()) == []


def test_remove_tree_never_follows_symlinks(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    (canary / "sub").mkdir(parents=True)
    (canary / "sub/keep").write_text("keep\n")
    t = tmp_path / "t"
    (t / "a/b").mkdir(parents=True)
    (t / "a/b/link").symlink_to(canary)
    (t / "a/sublink").symlink_to(canary / "sub")
    (t / "file").write_text("x")
    (t / "a/b/f").symlink_to(canary / "sub/keep")
    remove_tree(t)
    assert not t.exists() and not t.is_symlink()
    assert (canary / "sub/keep").read_text() == "keep\n"
    # a symlink as the tree itself is removed, its target kept
    (tmp_path / "top").symlink_to(canary)
    remove_tree(tmp_path / "top")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary"]
    assert (canary / "sub/keep").read_text() == "keep\n"


#: makes /deep a chain of 100 * `$1` dirs named `$2` from inside the sandbox: a chain of
#: 100 is made, the tree so far moved to its bottom, and the chain renamed /deep, so no path
#: the sandbox uses is longer than 100 names whatever the depth
_DEEP_SH = ('set -e; c=$2; j=1; while [ $j -lt 100 ]; do c="$c/$2"; j=$((j+1)); done; '
            'mkdir -p /deep/$c; i=1; while [ $i -lt "$1" ]; do mkdir -p /next/$c; '
            'mv /deep /next/$c/$2; mv /next /deep; i=$((i+1)); done; echo made')


def _make_deep(sb: Sandbox, depth: int, name: str) -> None:
    r = sb.exec(["sh", "-c", _DEEP_SH, "sh", str(depth), name])
    assert r.exit_code == 0 and b"made" in r.stdout, r


@root_only
def test_rm_of_a_deep_sandbox_tree(node_env: dict[str, str]) -> None:  # noqa: F811
    """2,100 levels of one-letter names, then 1,200 of 8-byte names (10 KB of path)."""
    state = node_env["DSEC_STATE_DIR"]
    sb = Sandbox.create(IMAGE, backend="container")
    try:
        _make_deep(sb, 21, "d")
        r = sb.exec(["sh", "-c", "mv /deep /deep1"])
        assert r.exit_code == 0, r
        _make_deep(sb, 12, "abcdefgh")
    except BaseException:
        sb.remove()
        raise
    p = dsec(node_env, "rm", sb.id, check=None)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p
    assert leaks(state) == {"mounts": [], "cgroups": [], "dirs": []}


@root_only
def test_gc_node_of_a_deep_sandbox_tree(node_env: dict[str, str]) -> None:  # noqa: F811
    state = node_env["DSEC_STATE_DIR"]
    sid = dsec(node_env, "run", "-d", IMAGE, "--ttl", "1h").stdout.decode().strip()
    try:
        p = dsec(node_env, "exec", sid, "--", "sh", "-c", _DEEP_SH, "sh", "21", "d")
        assert b"made" in p.stdout, p
        # the sandbox's init dies: gc finds it dead and removes it with its tree
        pid = json.loads(dsec(node_env, "inspect", sid, "--json").stdout)
        init = pid.get("pid") or pid.get("describe", {}).get("pid")
        assert init, pid
        os.kill(int(init), 9)
    except BaseException:
        dsec(node_env, "rm", "-f", sid, check=None)
        raise
    p = dsec(node_env, "gc", "--node", "--json", check=None)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p
    assert sid in p.stdout.decode()
    assert leaks(state) == {"mounts": [], "cgroups": [], "dirs": []}


@root_only
def test_snapshot_of_a_deep_sandbox_tree(node_env: dict[str, str]) -> None:  # noqa: F811
    """1,500 levels (3 KB of path, as deep as a layer holds paths) snapshot whole; 5,000
    levels are refused by name, exit 2, and the sandbox is left as it was."""
    sid = dsec(node_env, "run", "-d", IMAGE, "--ttl", "1h").stdout.decode().strip()
    try:
        p = dsec(node_env, "exec", sid, "--", "sh", "-c", _DEEP_SH, "sh", "15", "d")
        assert b"made" in p.stdout, p
        p = dsec(node_env, "snapshot", sid, "--as", "deep@1", check=None)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, p
        listing = dsec(node_env, "inspect", "deep@1", "--json", check=0)
        assert listing.returncode == 0
        p = dsec(node_env, "exec", sid, "--", "sh", "-c",
                 "mv /deep /deep1 && " + _DEEP_SH, "sh", "50", "d")
        assert b"made" in p.stdout, p
        p = dsec(node_env, "snapshot", sid, "--as", "deep@2", check=None)
        err = p.stderr.decode()
        assert p.returncode == 2 and "Traceback" not in err, (p.returncode, err)
        assert "nested deeper" in err, err
        assert dsec(node_env, "inspect", "deep@2", check=None).returncode != 0
        p = dsec(node_env, "exec", sid, "--", "echo", "alive", check=0)
        assert p.stdout.strip() == b"alive"
    finally:
        dsec(node_env, "rm", "-f", sid, check=None)


def test_walks_refuse_a_tree_deeper_than_a_layer_holds(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_cli.core.errors import FormatError
    from dsec_cli.format import tree

    ok, deep = tmp_path / "ok", tmp_path / "deep"
    ok.mkdir()
    deep.mkdir()
    _deep(ok, tree.MAX_DEPTH - 1)
    _deep(deep, 3 * tree.MAX_DEPTH)
    limit = sys.getrecursionlimit()
    try:
        for compiled in (True, False):
            monkeypatch.setattr(tree, "use_compiled", compiled)
            assert len(tree.walk_records(str(ok))) == tree.MAX_DEPTH + 1  # dirs, root, f
            with pytest.raises(FormatError, match="nested deeper"):
                tree.walk_records(str(deep))
            assert sys.getrecursionlimit() == limit
    finally:  # pytest's own clean-up of old temp dirs recurses
        remove_tree(ok)
        remove_tree(deep)


# -- what a layer may materialize --------------------------------------------------------------
CHUNK = 256 << 10
REPEATS = 2048  # a 512 MiB file of one 256 KiB chunk


@pytest.fixture
def bomb_layer(store_url: str) -> Iterator[tuple[str, str]]:  # noqa: F811
    """An image of busybox and a layer whose one file repeats one stored chunk: (image ref,
    the layer manifest's digest)."""
    st = open_store(store_url)
    data = os.urandom(CHUNK)
    pack = put_object(st, "packs", HEADER + data)  # stored raw: random bytes do not shrink
    ix = LayerIndex(entries=[Entry(".", "dir", 0o755),
                             Entry("big", "reg", 0o644, size=CHUNK * REPEATS,
                                   chunks=[(0, 0, CHUNK)] * REPEATS)],
                    chunks=[ChunkLoc(chunk_id(data), 0, len(HEADER), CHUNK, CHUNK, 0)],
                    packs=[pack])
    ixd = put_object(st, "indexes", ix.to_bytes())
    layer = put_manifest(st, Manifest(kind="layer", name="repeat", version="1", index=ixd,
                                      packs=[pack], content_digest=ix.content_digest(),
                                      size=CHUNK * REPEATS, files=1))
    set_ref(st, "repeat", "1", layer)
    base = get_ref(st, IMAGE).manifest
    img = put_manifest(st, Manifest(kind="image", name="repeat-img", version="1",
                                    layers=[base, layer]))
    set_ref(st, "repeat-img", "1", img)
    yield "repeat-img@1", layer


def _refused(p: subprocess.CompletedProcess[bytes], layer: str) -> None:
    err = p.stderr.decode()
    assert p.returncode == 2 and "Traceback" not in err, (p.returncode, err)
    assert layer[:12] in err and str(CHUNK * REPEATS) in err and "expansion" in err, err


@root_only
@pytest.mark.parametrize("how", ["run", "export"])
def test_layer_repeating_one_chunk_is_refused(how: str, bomb_layer: tuple[str, str],
                                              node_env: dict[str, str],  # noqa: F811
                                              tmp_path: Path) -> None:
    ref, layer = bomb_layer
    state = Path(node_env["DSEC_STATE_DIR"])
    if how == "run":
        p = dsec(node_env, "run", "--backend", "fncall", ref, "--", "true", check=None)
    else:
        p = dsec(node_env, "export", ref, str(tmp_path / "out"), check=None)
        assert not (tmp_path / "out").exists()
    _refused(p, layer)
    assert tree_size(state) < 64 << 20  # nothing near the file's size was written
    # a normal layer still runs
    p = dsec(node_env, "run", "--backend", "fncall", IMAGE, "--", "echo", "ok", check=0)
    assert p.stdout.strip() == b"ok"


# -- dedup does not decode what nobody asked for -------------------------------------------------
def _zeros_frame(n: int) -> bytes:
    obj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    block = bytes(16 << 20)
    return b"".join(obj.compress(block) for _ in range(n // len(block))) + obj.flush()


def test_index_bomb_is_not_decoded_by_other_builds(tmp_path: Path) -> None:
    """A 1 GiB index bomb of a few KiB published as a layer: a build of an unrelated layer
    warns naming it and stays far below the bomb's size."""
    url = (tmp_path / "store").as_uri()
    st = open_store(url)
    bomb = _zeros_frame(1 << 30)
    ix = put_object(st, "indexes", bomb)
    layer = put_manifest(st, Manifest(kind="layer", name="bomb", version="1", index=ix,
                                      content_digest="0" * 64))
    set_ref(st, "bomb", "1", layer)
    (tmp_path / "spec/t").mkdir(parents=True)
    (tmp_path / "spec/t/x.txt").write_text("x\n")
    (tmp_path / "spec/n.yaml").write_text('layer: n\nversion: "1"\nsteps:\n'
                                          "  - copy: {src: ./t, dst: /t}\n")
    env = {**os.environ, "DSEC_STORE": url, "DSEC_STATE_DIR": str(tmp_path / "node"),
           "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-c", PEAK_RSS_CODE, "build", str(tmp_path / "spec")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert ix[:12] in p.stderr, p.stderr
    rss_kib = int(p.stderr.rsplit("maxrss", 1)[1].split()[0])
    assert rss_kib < 200 << 10, rss_kib
