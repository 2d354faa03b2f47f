"""Clean task images: a git repository reduced to one commit at the task's base.

An agent that can read the upstream fix from the repository's history (other commits, tags,
reflogs, remotes, stashes, packed objects nothing points at) does not need to write it.
`scrub` replaces ``.git`` with a fresh repository holding exactly one parentless commit
whose tree is the base's tree, and checks the base's tree out; `check` lists every way a
repository reaches past that (the build fails on any).

Both run the host's git under bubblewrap with only the repository writable and nothing else
of the host in view: the repository is untrusted input (its config can name commands, its
files can be symlinks out of it).
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.oneshot import run_host_tool
from ..core.errors import BuildError, UsageError

#: identity and message of the one commit a scrubbed repository holds
AUTHOR = ("dsec", "dsec@localhost")
MESSAGE = "task base"
BRANCH = "main"
#: the longest a scrub or a check may take
TIMEOUT = 1800.0

_GIT_ENV = {
    "PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": AUTHOR[0], "GIT_AUTHOR_EMAIL": AUTHOR[1],
    "GIT_COMMITTER_NAME": AUTHOR[0], "GIT_COMMITTER_EMAIL": AUTHOR[1],
    # a layer's files may belong to any uid: git must not refuse them as "dubious"
    "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*",
}

# The base is resolved in a throwaway bare repository that borrows the old one's objects
# (alternates) and copies its refs, never reading its config or hooks. The new repository
# borrows the same objects, commits the base's tree, repacks everything reachable into its
# own pack (`repack -a` copies borrowed objects) and drops the loan.
_SCRUB = r"""
set -eu
old=/repo/.git
probe=/tmp/probe.git
new=/repo/.git.dsec-new
rm -rf "$new" /repo/.git.dsec-old
git init -q --bare "$probe"
cp "$old/HEAD" "$probe/HEAD"
if [ -d "$old/refs" ]; then cp -R "$old/refs/." "$probe/refs/"; fi
if [ -f "$old/packed-refs" ]; then cp "$old/packed-refs" "$probe/packed-refs"; fi
echo "$old/objects" > "$probe/objects/info/alternates"
tree=$(git --git-dir="$probe" rev-parse --verify --quiet "$DSEC_BASE^{tree}") || {
  echo "dsec: base $DSEC_BASE is not a commit or tree of this repository"; exit 3; }
git init -q --bare --initial-branch="$DSEC_BRANCH" "$new"
rm -rf "$new/hooks" "$new/description" "$new/info"
echo "$old/objects" > "$new/objects/info/alternates"
commit=$(git --git-dir="$new" commit-tree "$tree" -m "$DSEC_MESSAGE")
git --git-dir="$new" update-ref "refs/heads/$DSEC_BRANCH" "$commit"
git --git-dir="$new" repack -a -d -q
rm -f "$new/objects/info/alternates"
git --git-dir="$new" config core.bare false
git --git-dir="$new" config core.logAllRefUpdates false
rm -rf "$new/logs"
mv "$old" /repo/.git.dsec-old
mv "$new" "$old"
rm -rf /repo/.git.dsec-old
cd /repo
git read-tree --reset -u "$commit"
git read-tree "$commit"
rm -rf "$old/logs"
"""

# Every way a repository can reach past its one commit, printed one per line.
_CHECK = r"""
set -u
g=/repo/.git
cd /repo
[ -d "$g" ] && [ ! -L "$g" ] || { echo ".git is not a directory"; exit 0; }
for f in ORIG_HEAD FETCH_HEAD MERGE_HEAD CHERRY_PICK_HEAD REVERT_HEAD shallow \
         objects/info/alternates objects/info/http-alternates modules logs rebase-merge \
         rebase-apply worktrees; do
  [ -e "$g/$f" ] || [ -L "$g/$f" ] && echo "present: .git/$f"
done
head=$(git rev-parse --verify --quiet HEAD^{commit}) || { echo "HEAD names no commit"; exit 0; }
refs=$(git for-each-ref --format='%(refname)')
for r in $refs; do
  [ "$(git rev-parse "$r")" = "$head" ] || echo "ref $r points past the base"
  case "$r" in refs/heads/*) ;; *) echo "ref $r is not a branch";; esac
done
parents=$(git rev-list --parents -n1 "$head" | wc -w)
[ "$parents" = 1 ] || echo "the base commit has parents"
git config --get-regexp '^(remote|branch)\.' >/dev/null && echo "remotes configured"
git rev-list --objects "$head" | cut -d' ' -f1 | sort -u > /tmp/reachable
git cat-file --batch-all-objects --batch-check='%(objectname)' | sort -u > /tmp/present
comm -13 /tmp/reachable /tmp/present | sed 's/^/object not reachable from the base: /'
git count-objects -v | awk '$1=="garbage:" && $2!="0" {print "garbage files in .git/objects"}'
exit 0
"""


@dataclass
class GitCheck:
    """What `check` found: an empty ``problems`` is a clean repository."""

    path: str
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems


def repo_dir(root: Path, path: str) -> Path:
    """``path`` (absolute, inside the tree at ``root``) as a host path, refusing any symlink
    on the way: the bind mount must land on the repository itself, never where a link in an
    untrusted tree points."""
    if not path.startswith("/") or ".." in path.split("/"):
        raise UsageError(f"git repository path {path!r} must be absolute, without `..`")
    here = root
    for part in [p for p in posixpath.normpath(path).split("/") if p]:
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            raise UsageError(f"no git repository at {path}: {part!r} does not exist") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"git repository path {path}: {part!r} is not a directory "
                             "(symlinks are not followed)")
    git = here / ".git"
    if not git.is_dir() or git.is_symlink():
        raise UsageError(f"no git repository at {path} (.git must be a directory)")
    return here


def scrub(root: Path, path: str, base: str = "HEAD", *, epoch: int = 0) -> None:
    """Reduce the repository at ``path`` in the tree at ``root`` to one commit holding the
    tree of ``base``, checked out. ``epoch`` (seconds) dates the commit, so the same base
    gives the same commit id."""
    if not base or base.startswith("-") or any(c in base for c in "\0\n "):
        raise UsageError(f"invalid git base {base!r}")
    repo = repo_dir(root, path)
    date = f"@{epoch} +0000"
    env = {**_GIT_ENV, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date,
           "DSEC_BASE": base, "DSEC_BRANCH": BRANCH, "DSEC_MESSAGE": MESSAGE}
    code, out = run_host_tool(["/bin/sh", "-c", _SCRUB], binds={repo: "/repo"}, env=env,
                              timeout=TIMEOUT)
    if code != 0:
        raise BuildError(f"cannot scrub the git repository at {path}: {out.strip()[-2000:]}")
    found = check(root, path)
    if not found.clean:
        raise BuildError(f"the git repository at {path} still reaches past its base after "
                         f"scrubbing: {'; '.join(found.problems[:5])}")


def check(root: Path, path: str) -> GitCheck:
    """Every way the repository at ``path`` reaches past a single parentless commit."""
    repo = repo_dir(root, path)
    code, out = run_host_tool(["/bin/sh", "-c", _CHECK], binds={repo: "/repo"},
                              env=dict(_GIT_ENV), timeout=TIMEOUT)
    if code != 0:
        raise BuildError(f"cannot check the git repository at {path}: {out.strip()[-2000:]}")
    return GitCheck(path, [line for line in out.splitlines() if line.strip()])
