"""Build steps: turning a layer spec's copy / extract / run steps into a tree of entries.

A spec without `run` steps is built *virtually*: entries point at their sources (host files,
spooled archive members) and nothing is copied. A spec with `run` steps is built in a staging
upper directory: earlier steps are written into it, then each command runs over an overlay of
the `from` layers and that upper directory; the upper directory, deletions included as
whiteouts, becomes the layer.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.errors import BuildError, DsecError
from ..core.files import remove_tree
from ..format.index import Entry
from ..format.tree import Scanned, TreeWriter, parent_of, scan_dir
from .spec import Spec, Step

log = logging.getLogger(__name__)

#: steps that need the layer staged in a real directory (an overlay over `from`)
STAGED_STEPS = ("run", "git_scrub")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def source_date_epoch() -> int:
    """Timestamp (ns) for what `copy`, `extract` and `run` steps write; SOURCE_DATE_EPOCH
    (seconds) when set, else 0."""
    return int(os.environ.get("SOURCE_DATE_EPOCH", "0")) * 1_000_000_000


def _dir_entry(path: str, mtime: int) -> Scanned:
    return Scanned(Entry(path, "dir", 0o755, 0, 0, mtime), None)


def copy_entries(step: Step, sde: int) -> list[Scanned]:
    src: Path = step.args["src"]
    dst = step.args["dst"].strip("/")
    uid, gid = step.args.get("owner", (0, 0))
    mode = step.args.get("mode")
    if src.is_dir():
        scanned = scan_dir(src)
    else:
        st = src.stat()
        scanned = [Scanned(Entry(".", "reg", st.st_mode & 0o7777, mtime=st.st_mtime_ns,
                                 size=st.st_size), str(src))]
    prefix = f"{dst}/" if dst else ""
    for s in scanned:  # fresh entries from the scan: rewritten in place
        e = s.entry
        e.path = (dst or ".") if e.path == "." else prefix + e.path
        if e.type == "hard":
            e.target = prefix + e.target
        e.uid, e.gid = uid, gid
        if e.xattrs:
            e.xattrs = {k: v for k, v in e.xattrs.items() if not k.startswith("security.")}
        if mode is not None and e.type != "sym":
            e.mode = mode
    return scanned


def with_parents(scanned: list[Scanned], existing: Callable[[str], bool], sde: int
                 ) -> list[Scanned]:
    """Add directory entries for any missing ancestors (mode 0755, root-owned); a directory
    the entries themselves hold is not missing."""
    extra: dict[str, Scanned] = {}
    dirs = {s.entry.path for s in scanned if s.entry.type == "dir"}
    for s in scanned:
        p = s.entry.path
        while p != ".":
            p = parent_of(p)
            if p in dirs or p in extra or existing(p):
                break
            extra[p] = _dir_entry(p, sde)
    if "." not in dirs and not existing(".") and "." not in extra:
        extra["."] = _dir_entry(".", sde)
    return list(extra.values()) + scanned


class VirtualTree:
    """The layer as a mapping path -> entry; later steps override earlier ones."""

    def __init__(self) -> None:
        self.items: dict[str, Scanned] = {}

    def add(self, scanned: list[Scanned], sde: int) -> None:
        def exists(p: str) -> bool:
            return p in self.items and self.items[p].entry.type == "dir"

        for s in with_parents(scanned, exists, sde):
            old = self.items.get(s.entry.path)
            if old is not None and old.entry.type == "dir" and s.entry.type != "dir":
                prefix = s.entry.path + "/"
                for k in [k for k in self.items if k.startswith(prefix)]:
                    del self.items[k]
            self.items[s.entry.path] = s

    def scanned(self) -> list[Scanned]:
        return [self.items[k] for k in sorted(self.items)]


def _mount_overlay(lowers: list[Path], upper: Path, work: Path, merged: Path) -> None:
    # overlayfs lists lower dirs top first
    lower = ":".join(str(p) for p in reversed(lowers))
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if not lowers:
        # overlayfs needs a lower dir: an empty one stands for "from scratch"
        empty = work.parent / "empty"
        empty.mkdir(exist_ok=True)
        opts = f"lowerdir={empty},upperdir={upper},workdir={work}"
    r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"cannot mount the build overlay: {r.stderr.strip()}",
                         hint="`run` steps need root and overlayfs")


def _umount(merged: Path) -> None:
    subprocess.run(["umount", "-l", str(merged)], capture_output=True)



def _fs_tick(where: Path) -> int:
    """A ctime threshold on the filesystem's own clock: inode times come from the kernel's
    coarse clock, which lags `time.time_ns()` by up to a tick, so a file a command writes at
    once could look older than a threshold read from the wall clock. Wait for the next tick,
    so everything written before has an older ctime and everything after a newer or equal one."""
    probe = where / ".dsec-tick"
    probe.touch()
    first = probe.stat().st_ctime_ns
    while True:
        os.utime(probe)  # a metadata change: its ctime is the filesystem's now
        now = probe.stat().st_ctime_ns
        if now > first:
            probe.unlink()
            return now
        time.sleep(0.001)


class StagedTree:
    """The layer as an overlayfs upper directory, for specs with `run` steps."""

    def __init__(self, staging: Path, lowers: list[Path]) -> None:
        self.upper = staging / "upper"
        self.work = staging / "work"
        self.merged = staging / "merged"
        for d in (self.upper, self.work, self.merged):
            d.mkdir(parents=True, exist_ok=True)
        self.lowers = lowers
        self.touched_after: list[int] = []  # ctime thresholds of run steps

    def add(self, scanned: list[Scanned], sde: int, read: Callable[[Scanned], Any]) -> None:
        def exists(p: str) -> bool:
            return (self.upper / p).is_dir() or any((lo / p).is_dir() for lo in self.lowers)

        # the safe writer: an extract step's members (or what an earlier `run` step left in
        # the upper dir) cannot make an entry land outside it
        with TreeWriter(self.upper, overlay_form=True) as w:
            for s in with_parents(scanned, exists, sde):
                w.write(s.entry, read(s) if s.entry.type == "reg" else None)
            w.finish()

    def is_dir(self, rel: str) -> bool:
        """Whether the stacked tree holds a directory at ``rel`` (upper dir first)."""
        for top in (self.upper, *reversed(self.lowers)):
            p = top / rel
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                return False
            if p.is_dir():
                return True
        return False

    def read_file(self, rel: str, limit: int = 1 << 20) -> bytes | None:
        """A regular file of the stacked tree (upper dir first), never through a symlink;
        None where no layer has one."""
        for top in (self.upper, *reversed(self.lowers)):
            p = top / rel
            parts = [top / Path(*Path(rel).parts[:i + 1]) for i in range(len(Path(rel).parts))]
            if any(x.is_symlink() for x in parts):
                return None
            if p.is_file():
                with open(p, "rb") as f:
                    return f.read(limit)
            if os.path.lexists(p):
                return None
        return None

    def run_argv(self, argv: list[str], *, env: dict[str, str], cwd: str = "/",
                 network: bool = False, egress: list[str] | None = None,
                 on_line: Callable[[str], None] | None = None,
                 check: Callable[[Path], None] | None = None) -> int:
        """Run ``argv`` in a build sandbox over the stacked tree (``check`` called with the
        mounted root first); its changes go to the upper dir. ``network`` with ``egress``:
        only those rules' hosts (oneshot.run_in_root). Returns the exit code."""
        if os.geteuid() != 0:
            raise BuildError("commands in a build need root (overlayfs, namespaces)")
        self.touched_after.append(_fs_tick(self.upper.parent))
        lowers = self.lowers
        if network and egress is not None:
            # an /etc/hosts below every layer, for the allowlist's pinned names to be bound
            # over when the image has none (docker always gives RUN one); never in the layer
            below = self.upper.parent / "hosts-lower"
            (below / "etc").mkdir(parents=True, exist_ok=True)
            (below / "etc/hosts").write_bytes(b"127.0.0.1 localhost\n")
            lowers = [below, *self.lowers]
        _mount_overlay(lowers, self.upper, self.work, self.merged)
        try:
            if check is not None:
                check(self.merged)
            from ..backends.oneshot import run_in_root  # only `run` steps start a sandbox

            return run_in_root(self.merged, argv, env=env, cwd=cwd, network=network,
                               egress=egress, on_line=on_line)
        finally:
            _umount(self.merged)

    def run(self, spec: Spec, step: Step, env: dict[str, str],
            on_line: Callable[[str], None] | None) -> None:
        if os.geteuid() != 0:
            raise BuildError(f"{spec.path}:{step.line}: `run` steps need root (overlayfs, "
                             "namespaces)")

        def has_sh(merged: Path) -> None:
            if not (merged / "bin/sh").exists() and not (merged / "bin/sh").is_symlink():
                bases = ", ".join(r for r, _ in spec.deps) or "none"
                raise BuildError(f"{spec.path}:{step.line}: `run` needs /bin/sh in the layers "
                                 f"this spec builds `from` ({bases})")

        code = self.run_argv(["/bin/sh", "-c", step.args["cmd"]],
                             env={**env, **step.args["env"]}, network=step.args["network"],
                             on_line=on_line, check=has_sh)
        if code != 0:
            raise BuildError(f"{spec.path}:{step.line}: run step exited with code {code}: "
                             f"{step.args['cmd']!r}")

    def git_scrub(self, spec: Spec, step: Step, sde: int) -> None:
        """Reduce a repository in the layer (or below it) to one commit at its base; what
        was below becomes whiteouts, so only scrub where the history is added."""
        from .gitscrub import scrub

        if os.geteuid() != 0:
            raise BuildError(f"{spec.path}:{step.line}: `git_scrub` steps need root (overlayfs)")
        self.touched_after.append(_fs_tick(self.upper.parent))
        _mount_overlay(self.lowers, self.upper, self.work, self.merged)
        try:
            scrub(self.merged, step.args["path"], step.args["base"], epoch=sde // 1_000_000_000)
        except DsecError as e:
            raise BuildError(f"{spec.path}:{step.line}: {e.message}") from e
        finally:
            _umount(self.merged)

    def scanned(self, sde: int) -> list[Scanned]:
        out = scan_dir(self.upper, overlay_upper=True)
        first_run = min(self.touched_after) if self.touched_after else None
        for s in out:
            # what the commands wrote gets the fixed timestamp, as with SOURCE_DATE_EPOCH
            if first_run is not None and s.ctime >= first_run and s.entry.type != "whiteout":
                s.entry.mtime = sde
        return out


# -- staging directories, and cleaning up after a killed build ---------------------------------

STAGING_PREFIX = "build-"
OWNER_FILE = "owner.json"
#: a staging dir without an owner marker is being set up (or was made by an older dsec that
#: wrote none): it is left alone this long
_UNMARKED_GRACE = 24 * 3600.0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with
    the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields follow the last ')'
    return int(data[data.rindex(b")") + 2:].split()[19])


def make_staging(tmp_root: Path) -> Path:
    """A fresh staging dir for one build, marked with this process's pid and start time so a
    later build or `dsec gc --node` can tell it was left by a build that died."""
    tmp_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=tmp_root))
    owner = {"pid": os.getpid(), "start": _start_time(os.getpid())}
    (staging / OWNER_FILE).write_text(json.dumps(owner))
    return staging


def _alive(staging: Path) -> bool:
    try:
        owner = json.loads((staging / OWNER_FILE).read_text())
        pid, start = int(owner["pid"]), owner["start"]
    except FileNotFoundError:
        try:  # just made, marker not yet written
            return time.time() - staging.stat().st_mtime < _UNMARKED_GRACE
        except FileNotFoundError:
            return True  # removed meanwhile: nothing to do
    except (ValueError, KeyError, TypeError):
        return False
    return _start_time(pid) == start


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts_below(path: Path) -> list[str]:
    base = str(path)
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = _unescape_mountinfo(line.split()[4])
            if point == base or point.startswith(base + "/"):
                out.append(point)
    return sorted(out, key=len, reverse=True)  # deepest first


def clean_stale_staging(tmp_root: Path, dry_run: bool = False) -> list[str]:
    """Unmount and remove the staging dirs of builds that no longer run (killed during a
    `run` step, their overlay mount is still there); return their paths."""
    if not tmp_root.is_dir():
        return []
    removed: list[str] = []
    for staging in sorted(tmp_root.glob(STAGING_PREFIX + "*")):
        if not staging.is_dir() or staging.is_symlink() or _alive(staging):
            continue
        removed.append(str(staging))
        if dry_run:
            continue
        for point in _mounts_below(staging):
            subprocess.run(["umount", "-l", point], capture_output=True)
        if _mounts_below(staging):
            # never rmtree through a mount: it would reach into the layers below
            log.warning("cannot unmount everything below %s; left in place", staging)
            removed.pop()
            continue
        remove_tree(staging)
        log.info("removed the staging dir %s of a build that died", staging)
    return removed


def run_env(spec: Spec, base_env: dict[str, str]) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    env.update(base_env)
    env.update(spec.env)
    env["SOURCE_DATE_EPOCH"] = str(source_date_epoch() // 1_000_000_000)
    return env


def build_tree(spec: Spec, staging: Path, lowers: list[Path], base_env: dict[str, str],
               on_line: Callable[[str], None] | None = None) -> list[Scanned]:
    """Run a layer spec's steps; return the layer's entries (sorted, with sources)."""
    sde = source_date_epoch()
    if not any(s.kind in STAGED_STEPS for s in spec.steps):
        vt = VirtualTree()
        for n, step in enumerate(spec.steps):
            vt.add(_step_entries(step, staging / f"spool-{n}", sde), sde)
        return vt.scanned()
    st = StagedTree(staging, lowers)
    env = run_env(spec, base_env)
    for n, step in enumerate(spec.steps):
        if step.kind == "run":
            st.run(spec, step, env, on_line)
        elif step.kind == "git_scrub":
            st.git_scrub(spec, step, sde)
        else:
            st.add(_step_entries(step, staging / f"spool-{n}", sde), sde, _read_source)
    return st.scanned(sde)


def _read_source(s: Scanned) -> Iterator[bytes]:
    assert s.source is not None
    with open(s.source, "rb") as f:
        while piece := f.read(1 << 20):
            yield piece


def _step_entries(step: Step, spool: Path, sde: int) -> list[Scanned]:
    if step.kind == "copy":
        return reproducible(copy_entries(step, sde), step, sde)
    if step.kind == "extract":
        from .tarball import read_tar

        return reproducible(read_tar(step.args["src"], step.args["dst"], spool), step, sde)
    raise AssertionError(step.kind)


def reproducible(scanned: list[Scanned], step: Step, sde: int) -> list[Scanned]:
    """A copy's or extract's entries made independent of when and by whom the sources were
    checked out: every mtime becomes ``sde`` unless the step says ``keep_mtime: true``, and
    the step's ``owner:`` (if any) owns every entry."""
    owner = step.args.get("owner")
    keep = step.args.get("keep_mtime", False)
    for s in scanned:
        if not keep:
            s.entry.mtime = sde
        if owner is not None:
            s.entry.uid, s.entry.gid = owner
    return scanned
