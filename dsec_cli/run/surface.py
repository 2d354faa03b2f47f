"""What of an agent's changes a scoring fork takes: the task's patch surface (paths and globs),
minus the files Python and pytest run on their own; and the tamper audit of protected paths.

A sandbox's changes are read from its writable diff (overlayfs upper form) on the host: the
diff is hostile input, walked without following a link, files read with ``O_NOFOLLOW``,
bounded in count and bytes."""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

#: names never taken from an agent, whatever the surface says: each runs code in the grader's
#: Python or configures its test runner
NEVER_TAKEN = ("**/conftest.py", "**/sitecustomize.py", "**/usercustomize.py", "**/*.pth",
               "**/*.pyc", "**/__pycache__/**", "**/pytest.ini", "**/tox.ini", "**/setup.cfg",
               "**/pyproject.toml", "**/.pytest_cache/**", "**/*.so", "**/*.egg-link",
               "**/entry_points.txt")
#: caches an honest run of Python or pytest writes: never taken, never a tamper
CACHES = ("**/*.pyc", "**/__pycache__/**", "**/.pytest_cache/**")
#: protected in every task: the same hooks, and the interpreter's own package directories
PROTECTED_ALWAYS = (*(p for p in NEVER_TAKEN if p not in CACHES), "**/site-packages/**",
                    "**/dist-packages/**")
#: bounds on what a fork takes from an agent (files past them are dropped, with why)
MAX_FILES = 10_000
MAX_BYTES = 256 << 20
#: the longest list of dropped changes a result carries (the rest are counted)
MAX_DROPPED = 1000

_WHITEOUT = "whiteout"


def _glob_re(pattern: str) -> re.Pattern[str]:
    """A path glob: ``**`` spans directories, ``*`` and ``?`` stay inside one name."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z", re.S)


class Patterns:
    """Globs anchored at a directory (relative ones) or at / (absolute ones)."""

    def __init__(self, patterns: list[str] | tuple[str, ...], workdir: str = "/") -> None:
        self.patterns = list(patterns)
        self._res = []
        for p in patterns:
            if p.startswith("**"):
                full = p  # anywhere
            elif p.startswith("/"):
                full = p.lstrip("/")
            else:
                full = posixpath.join(workdir, p).lstrip("/")
            self._res.append(_glob_re(full.rstrip("/")))
            if p.endswith("/"):
                self._res.append(_glob_re(full.rstrip("/") + "/**"))

    def match(self, path: str) -> bool:
        """``path`` relative to / (``testbed/calc.py``)."""
        return any(r.match(path) for r in self._res)


@dataclass
class Change:
    path: str  # relative to /
    kind: str  # reg | whiteout | sym | dir | other
    mode: int = 0o644
    data: bytes | None = None
    digest: str = ""


@dataclass
class Diff:
    """A sandbox's changes: files written (with contents, when asked), paths deleted."""

    changes: list[Change] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)  # directories replaced as a whole


def _read_nofollow(path: Path, limit: int) -> bytes | None:
    """The file's bytes, or None when it is not a regular file or passes ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, total = [], 0
        while piece := os.read(fd, 1 << 20):
            total += len(piece)
            if total > limit:
                return None
            chunks.append(piece)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _hash_nofollow(path: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return h.hexdigest()


def read_diff(upper: Path, want: Patterns | None = None, hashed: Patterns | None = None
              ) -> Diff:
    """Every change in an upper dir; the contents of regular files ``want`` matches (all of
    them when ``want`` is None) are read, within the bounds, and those ``hashed`` matches
    get their digest."""
    out = Diff()
    budget, taken = MAX_BYTES, 0
    stack = [("", upper)]
    while stack:
        rel, here = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except NotADirectoryError:
            continue
        for e in entries:
            path = f"{rel}{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                try:
                    if os.getxattr(e.path, "trusted.overlay.opaque",
                                   follow_symlinks=False) == b"y":
                        out.opaque.append(path)
                except OSError:
                    pass
                stack.append((path + "/", Path(e.path)))
            elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                out.changes.append(Change(path, _WHITEOUT))
            elif stat.S_ISREG(st.st_mode):
                c = Change(path, "reg", st.st_mode & 0o777)
                if (want is None or want.match(path)) and taken < MAX_FILES:
                    c.data = _read_nofollow(Path(e.path), budget)
                    if c.data is None:
                        c.kind = "too-large"  # past the bound: dropped
                    else:
                        budget -= len(c.data)
                        taken += 1
                        c.digest = hashlib.sha256(c.data).hexdigest()
                elif want is None or want.match(path):
                    c.kind = "too-many"
                elif hashed is not None and hashed.match(path):
                    c.digest = _hash_nofollow(Path(e.path))
                out.changes.append(c)
            elif stat.S_ISLNK(st.st_mode):
                out.changes.append(Change(path, "sym", digest="sym:" + os.readlink(e.path)))
            else:
                out.changes.append(Change(path, "other"))
    out.changes.sort(key=lambda c: c.path)
    return out


def split_surface(diff: Diff, surface: Patterns) -> tuple[list[Change], list[dict[str, str]]]:
    """The changes a fork takes (regular files written, files deleted, on the surface and
    not among `NEVER_TAKEN`) and the ones it drops, each with why."""
    never = Patterns(NEVER_TAKEN)
    taken, dropped = [], []
    for c in diff.changes:
        try:
            c.path.encode("utf-8")
        except UnicodeEncodeError:
            dropped.append({"path": os.fsencode(c.path).decode("utf-8", "backslashreplace"),
                            "why": "the name is not UTF-8"})
            continue
        if c.kind == "too-large":
            dropped.append({"path": c.path, "why": f"past the patch bound ({MAX_BYTES} "
                            "bytes in all), or not a regular file when read"})
        elif c.kind == "too-many":
            dropped.append({"path": c.path, "why": f"past the patch bound ({MAX_FILES} "
                            "files)"})
        elif not surface.match(c.path):
            dropped.append({"path": c.path, "why": "outside the patch surface"})
        elif never.match(c.path):
            dropped.append({"path": c.path, "why": "runs code in the grader (never taken)"})
        elif c.kind not in ("reg", _WHITEOUT):
            dropped.append({"path": c.path, "why": f"a {c.kind}, not a regular file"})
        else:
            taken.append(c)
    if len(dropped) > MAX_DROPPED:
        dropped = dropped[:MAX_DROPPED] + [{"path": "...", "why": f"{len(dropped) - MAX_DROPPED} "
                                            "more changes dropped"}]
    return taken, dropped


# -- tamper audit ------------------------------------------------------------------------------
def file_digest(path: Path) -> str | None:
    """sha256 of a regular file, ``sym:TARGET`` for a link, ``dir``, or None when absent."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        return "sym:" + os.readlink(path)
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if not stat.S_ISREG(st.st_mode):
        return f"type:{stat.S_IFMT(st.st_mode):o}"
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return h.hexdigest()


def in_lowers(lowers: list[Path], path: str) -> str | None:
    """A path's digest in a stack of read-only layer dirs (top last), whiteouts applied."""
    for lower in reversed(lowers):
        d = file_digest(lower / path)
        if d is not None:
            return None if d.startswith("type:20") else d  # a 0:0 char dev is a whiteout
        # a whiteout of a parent hides the path too
        parent = path
        while "/" in parent:
            parent = parent.rsplit("/", 1)[0]
            pd = file_digest(lower / parent)
            if pd is not None and pd.startswith("type:20"):
                return None
    return None


class StartState:
    """Protected paths at task start: recorded by `start_task` (path -> digest), or, when
    nothing was recorded, the image's own layers (a sandbox starts with an empty diff)."""

    def __init__(self, lowers: list[Path], recorded: dict[str, str] | None = None) -> None:
        self.lowers = lowers
        self.recorded = recorded

    def get(self, path: str) -> str | None:
        if self.recorded is not None:
            return self.recorded.get(path)
        return in_lowers(self.lowers, path)

    def under(self, directory: str, protected: Patterns) -> list[str]:
        if self.recorded is not None:
            return [p for p in self.recorded if p.startswith(directory + "/")]
        found = set()
        for lower in self.lowers:
            top = lower / directory
            if top.is_symlink() or not top.is_dir():
                continue
            for dirpath, _, filenames in os.walk(top):
                for name in filenames:
                    rel = os.path.relpath(os.path.join(dirpath, name), lower)
                    if protected.match(rel):
                        found.add(rel)
        return sorted(p for p in found if in_lowers(self.lowers, p) is not None)


def record_start(lowers: list[Path], diff: Diff, protected: Patterns) -> dict[str, str]:
    """The digest of every protected path in the merged view now (lowers, then the diff)."""
    out: dict[str, str] = {}
    for lower in lowers:
        for dirpath, _, filenames in os.walk(lower):
            for name in filenames:
                rel = os.path.relpath(os.path.join(dirpath, name), lower)
                if protected.match(rel):
                    out[rel] = ""
    merged = {p: d for p in out if (d := in_lowers(lowers, p)) is not None}
    for d in diff.opaque:
        for p in [p for p in merged if p.startswith(d + "/")]:
            del merged[p]
    for c in diff.changes:
        if not protected.match(c.path):
            continue
        if c.kind == _WHITEOUT:
            merged.pop(c.path, None)
        else:
            merged[c.path] = c.digest or f"type:{c.kind}"
    return dict(sorted(merged.items()))


def audit(start: StartState, diff: Diff, protected: Patterns) -> dict[str, list[str]]:
    """Which protected paths the agent changed, created or deleted since ``start``."""
    out: dict[str, list[str]] = {"changed": [], "created": [], "deleted": []}
    caches = Patterns(CACHES)
    seen = set()
    for c in diff.changes:
        if c.kind == _WHITEOUT:  # a deleted directory deletes what it held
            out["deleted"] += start.under(c.path, protected)
        if not protected.match(c.path) or caches.match(c.path):
            continue
        seen.add(c.path)
        before = start.get(c.path)
        if c.kind == _WHITEOUT:
            if before is not None and before != "dir":
                out["deleted"].append(c.path)
            continue
        now = c.digest or f"type:{c.kind}"
        if before is None:
            out["created"].append(c.path)
        elif now != before:
            out["changed"].append(c.path)
    for d in diff.opaque:  # a directory replaced as a whole deletes what it held
        out["deleted"] += [p for p in start.under(d, protected) if p not in seen]
    return {k: sorted(set(v)) for k, v in out.items()}
