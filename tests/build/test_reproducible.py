"""The same spec gives the same digests wherever and whenever it is checked out: `copy` and
`extract` outputs get fixed timestamps (SOURCE_DATE_EPOCH, else 0) and copies root ownership,
unless the step asks otherwise (`keep_mtime: true`, `owner:`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec_cli.build.builder import build
from dsec_cli.build.spec import load_spec
from dsec_cli.core.errors import SpecError
from dsec_cli.push.materialize import export

from ..treecmp import describe
from .conftest import write_spec

REPO = Path(__file__).resolve().parents[2]
OLD = 981_173_106  # 2001-02-03: an mtime no build would pick by itself


def _files(root: Path) -> Path:
    (root / "files/sub").mkdir(parents=True)
    (root / "files/a.txt").write_text("a\n")
    (root / "files/sub/b.txt").write_text("b\n")
    (root / "files/link").symlink_to("a.txt")
    for p in [root / "files", *(root / "files").rglob("*")]:
        os.utime(p, (OLD, OLD), follow_symlinks=False)
        os.lchown(p, 1234, 4321)
    return root


def _tarball(root: Path) -> None:
    subprocess.run(["tar", "--format=pax", "--owner=1234", "--group=4321", "--numeric-owner",
                    "-C", str(root / "files"), "-cf", str(root / "files.tar"), "."], check=True)


def test_copy_and_extract_get_fixed_time_and_owner(tmp_path: Path, store,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _files(tmp_path / "s")
    _tarball(spec)
    write_spec(spec, "r", 'layer: r\nversion: "1"\nsteps:\n'
               "  - copy: {src: ./files, dst: /c}\n"
               "  - extract: {src: ./files.tar, dst: /x}\n")
    write_spec(spec, "k", 'layer: k\nversion: "1"\nsteps:\n'
               "  - copy: {src: ./files, dst: /c, keep_mtime: true, owner: '7:8'}\n"
               "  - extract: {src: ./files.tar, dst: /x, keep_mtime: true, owner: '9:10'}\n")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    build([spec / "r.yaml", spec / "k.yaml"], store)
    export(store, "r@1", tmp_path / "r")
    export(store, "k@1", tmp_path / "k")
    r, k = describe(tmp_path / "r"), describe(tmp_path / "k")
    for p in ("c/a.txt", "c/sub", "c/sub/b.txt", "x/a.txt", "x/sub", "x/sub/b.txt"):
        assert r[p]["mtime"] == 1_700_000_000 * 10**9, (p, r[p])
        assert int(k[p]["mtime"] // 10**9) == OLD, (p, k[p])
    for p in ("c/a.txt", "c/sub", "c/link"):
        assert (r[p]["uid"], r[p]["gid"]) == (0, 0), (p, r[p])  # copies: root by default
        assert (k[p]["uid"], k[p]["gid"]) == (7, 8), (p, k[p])
    # an archive's recorded owners are part of its (hashed) bytes: kept unless `owner:`
    assert (r["x/a.txt"]["uid"], r["x/a.txt"]["gid"]) == (1234, 4321)
    assert (k["x/a.txt"]["uid"], k["x/a.txt"]["gid"]) == (9, 10)


def test_new_keys_are_in_the_spec_digest_and_checked(tmp_path: Path) -> None:
    spec = _files(tmp_path / "s")
    base = 'layer: d\nversion: "1"\nsteps:\n  - copy: {src: ./files, dst: /c%s}\n'
    digests = {}
    for name, extra in [("plain", ""), ("false", ", keep_mtime: false"),
                        ("keep", ", keep_mtime: true"), ("owner", ", owner: '0:5'")]:
        (spec / "d.yaml").write_text(base % extra)
        digests[name] = load_spec(spec / "d.yaml").digest()
    assert digests["plain"] == digests["false"]  # the default spelled out is the same spec
    assert len({digests["plain"], digests["keep"], digests["owner"]}) == 3
    (spec / "d.yaml").write_text(base % ", keep_mtimes: true")
    with pytest.raises(SpecError, match=r"unknown key 'keep_mtimes' in copy step") as e:
        load_spec(spec / "d.yaml")
    assert str(spec / "d.yaml") in str(e.value) and ":4" in str(e.value)
    (spec / "d.yaml").write_text(base % ", keep_mtime: yes please")
    with pytest.raises(SpecError, match="keep_mtime must be true or false"):
        load_spec(spec / "d.yaml")


def _digests(p: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return {i["ref"]: i["manifest"] for i in json.loads(p.stdout)["items"]}


def _prepare(tree: Path) -> None:
    subprocess.run(["bash", str(tree / "layerspecs/busybox/make-rootfs.sh")], check=True)


def test_layerspecs_from_two_copies_with_other_mtimes(tmp_path: Path, run_dsec) -> None:
    _prepare(REPO)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(REPO / "layerspecs", a / "layerspecs", symlinks=True)
    b.mkdir()
    subprocess.run(["cp", "-a", str(REPO / "layerspecs"), str(b)], check=True)
    subprocess.run(["find", str(b / "layerspecs"), "-exec", "touch", "-h", "-d",
                    "2003-04-05 06:07:08", "{}", "+"], check=True)
    for p in (b / "layerspecs").rglob("*"):
        os.lchown(p, 1000, 1000)  # another user's checkout
    da = _digests(run_dsec("build", "layerspecs", "--store", str(tmp_path / "sa"), "--json",
                           cwd=a))
    db = _digests(run_dsec("build", "layerspecs", "--store", str(tmp_path / "sb"), "--json",
                           cwd=b))
    assert set(da) == {"busybox@1.35-1", "tools@1", "webapp@1", "demo@1"}
    assert da == db


def test_layerspecs_from_two_git_clones(tmp_path: Path, run_dsec) -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    digests = []
    for n, when in enumerate(["2002-01-01 00:00:00", "2024-06-30 12:34:56"]):
        clone = tmp_path / f"clone{n}"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)],
                       check=True)
        subprocess.run(["find", str(clone / "layerspecs"), "-exec", "touch", "-h", "-d", when,
                        "{}", "+"], check=True)
        _prepare(clone)
        # run from outside the clone: the code under test is this checkout's, not the clone's
        digests.append(_digests(run_dsec("build", str(clone / "layerspecs"), "--store",
                                         str(tmp_path / f"store{n}"), "--json", cwd=tmp_path)))
    assert "webapp@1" in digests[0]
    assert digests[0] == digests[1]
