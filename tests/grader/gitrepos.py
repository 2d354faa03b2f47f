"""Git repositories with a history that holds a task's fix, as task layers ship them."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

_ENV = {"GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@example.com",
        "GIT_COMMITTER_NAME": "dev", "GIT_COMMITTER_EMAIL": "dev@example.com",
        "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env={**os.environ, **_ENV}).stdout.strip()


#: the fix, a string that must not be found anywhere in a scrubbed repository
FIX = "return a + b  # the upstream fix"


def repo_with_history(repo: Path, base_files: dict[str, str]) -> dict[str, str]:
    """A repository whose base commit holds ``base_files``; after it: the fix (a commit, a
    tag, a branch, a stash, a reflog entry and a remote), everything packed. Returns the ids
    of the base and fix commits and of the fix's blob."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    for name, text in base_files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "calc.py").write_text(f"def add(a, b):\n    {FIX}\n")
    git(repo, "commit", "-qam", "fix add")
    fix = git(repo, "rev-parse", "HEAD")
    blob = git(repo, "rev-parse", "HEAD:calc.py")
    git(repo, "tag", "-a", "v2", "-m", "release with the fix")
    git(repo, "branch", "upstream")
    git(repo, "remote", "add", "origin", "https://git.example.com/calc.git")
    git(repo, "reset", "-q", "--hard", base)
    (repo / "calc.py").write_text(f"def add(a, b):\n    {FIX} (wip)\n")
    git(repo, "stash", "-q")
    git(repo, "gc", "-q")
    return {"base": base, "fix": fix, "blob": blob}


def tar_dir(src: Path, dest: Path, arcname: str) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w") as tf:
        tf.add(src, arcname=arcname)
    return dest
