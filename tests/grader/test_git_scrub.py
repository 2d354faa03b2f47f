"""Clean task images: a repository reduced to one commit at the task's base, in a build step
and for an existing layer, and the check that fails on anything beyond the base."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dsec_cli.build.builder import build
from dsec_cli.build.gitscrub import check
from dsec_cli.core.errors import SpecError, UsageError
from dsec_cli.format.refs import resolve
from dsec_cli.push.materialize import export
from dsec_cli.push.stores import open_store

from ..build.conftest import write_spec
from .gitrepos import FIX, git, repo_with_history, tar_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="git_scrub steps mount overlayfs")

BASE_FILES = {"calc.py": "def add(a, b):\n    return a - b\n", "README": "calc\n"}


def _holds_fix(root: Path) -> bool:
    """Whether any byte under ``root`` (loose objects, packs, logs) still holds the fix:
    packed objects are zlib-compressed, so git itself is asked too."""
    repo = root / "testbed"
    found = subprocess.run(["git", "-C", str(repo), "log", "--all", "--reflog", "-p"],
                           capture_output=True, text=True).stdout
    objects = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "--batch-all-objects", "--batch"],
        capture_output=True).stdout
    return FIX in found or FIX.encode() in objects


@pytest.fixture
def history_tar(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    ids = repo_with_history(tmp_path / "repo", BASE_FILES)
    return tar_dir(tmp_path / "repo", tmp_path / "specs" / "repo.tar", "testbed"), ids


def test_unscrubbed_repository_fails_the_check(tmp_path: Path, history_tar) -> None:
    tar, ids = history_tar
    root = tmp_path / "plain"
    subprocess.run(["tar", "-xf", str(tar), "-C", str(tmp_path)], check=True)
    (tmp_path / "testbed").rename(root)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "testbed").symlink_to(root)
    with pytest.raises(UsageError, match="not a directory"):
        check(tmp_path / "p", "/testbed")  # a symlink on the way is never followed
    found = check(tmp_path, "/plain")
    assert not found.clean
    text = "\n".join(found.problems)
    for what in ("refs/tags/v2", "refs/stash", "remotes configured", "present: .git/logs",
                 f"object not reachable from the base: {ids['blob']}"):
        assert what in text


def test_git_scrub_step_leaves_only_the_base(tmp_path: Path, history_tar) -> None:
    tar, ids = history_tar
    spec = write_spec(tmp_path / "specs", "task", """
layer: task-repo
version: "1"
steps:
  - extract: {src: ./repo.tar, dst: /}
  - git_scrub: {path: /testbed, base: HEAD}
""")
    url = str(tmp_path / "store")
    build([spec], url)
    st = open_store(url)
    out = tmp_path / "out"
    export(st, "task-repo@1", out)
    assert check(out, "/testbed").clean
    assert not _holds_fix(out)
    repo = out / "testbed"
    assert git(repo, "log", "--all", "--format=%s") == "task base"
    assert git(repo, "rev-parse", "HEAD^{tree}") == git(tmp_path / "repo", "rev-parse",
                                                         f"{ids['base']}^{{tree}}")
    assert git(repo, "status", "--porcelain") == ""
    assert (repo / "calc.py").read_text() == BASE_FILES["calc.py"]
    # the same inputs give the same layer: the commit is dated by SOURCE_DATE_EPOCH
    again = tmp_path / "store2"
    build([spec], str(again))
    assert resolve(open_store(str(again)), "task-repo@1") == resolve(st, "task-repo@1")


def test_git_scrub_command_on_an_existing_layer(tmp_path: Path, history_tar, run_dsec) -> None:
    tar, ids = history_tar
    git(tmp_path / "repo", "checkout", "-q", ids["fix"])  # the worktree holds the fix
    tar_dir(tmp_path / "repo", tar, "testbed")
    spec = write_spec(tmp_path / "specs", "task", """
layer: task-repo
version: "1"
steps:
  - extract: {src: ./repo.tar, dst: /}
""")
    store = str(tmp_path / "store")
    build([spec], store)
    bad = run_dsec("git-check", "task-repo@1", "--path", "/testbed", "--store", store,
                   "--json", check=1)
    assert not json.loads(bad.stdout)["clean"]
    made = json.loads(run_dsec("git-scrub", "task-repo@1", "--path", "/testbed", "--base",
                               ids["base"], "--as", "task-repo@1-clean", "--store", store,
                               "--json").stdout)
    assert made["ref"] == "task-repo@1-clean"
    run_dsec("git-check", "task-repo@1-clean", "--path", "/testbed", "--store", store)
    out = tmp_path / "out"
    export(open_store(store), "task-repo@1-clean", out)
    assert not _holds_fix(out)
    assert (out / "testbed/calc.py").read_text() == BASE_FILES["calc.py"]
    # the original is left as it was
    run_dsec("git-check", "task-repo@1", "--path", "/testbed", "--store", store, check=1)
    nope = run_dsec("git-scrub", "task-repo@1", "--path", "/testbed", "--base", "no-such",
                    "--as", "x@1", "--store", store, check=1)
    assert "no-such" in nope.stderr


@pytest.mark.parametrize("step, message", [
    ("git_scrub: {path: /testbed, bogus: 1}", "unknown key 'bogus'"),
    ("git_scrub: {base: HEAD}", "needs `path:`"),
    ("git_scrub: {path: testbed}", "must be an absolute path"),
    ("git_scrub: {path: /testbed, base: --upload-pack=x}", "not a git revision"),
])
def test_bad_git_scrub_steps(tmp_path: Path, step: str, message: str) -> None:
    spec = write_spec(tmp_path / "specs", "bad", f"""
layer: bad
version: "1"
steps:
  - {step}
""")
    with pytest.raises(SpecError, match=message) as e:
        build([spec], str(tmp_path / "store"))
    assert e.value.line == 5
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("refs/*"))
