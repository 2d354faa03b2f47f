"""Trees on a real filesystem: scanning a directory into index entries, and writing
entries back out (as a plain tree, or in overlayfs form with whiteouts as 0:0 devices).

Writing never follows a symlink that the tree itself created: a layer that holds
``a -> /etc`` and ``a/passwd`` cannot write outside the destination.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import FormatError
from .index import Entry

OVERLAY_XATTR_PREFIX = "trusted.overlay."
OPAQUE_XATTR = "trusted.overlay.opaque"


def check_rel_path(path: str) -> str:
    """A normalized relative path inside a tree, or FormatError."""
    if path == ".":
        return path
    if not path or path.startswith("/") or "\x00" in path:
        raise FormatError(f"invalid path in tree: {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise FormatError(f"path escapes or is not normalized: {path!r}")
    return path


def parent_of(path: str) -> str:
    head = path.rpartition("/")[0]
    return head or "."


@dataclass
class Scanned:
    entry: Entry
    source: str | None  # host path holding a regular file's bytes
    ctime: int = 0  # change time (ns) of the host path, to tell what a step touched


def _xattrs(path: str, overlay_upper: bool) -> tuple[dict[str, bytes], bool]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}, False
    out: dict[str, bytes] = {}
    opaque = False
    for name in names:
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        if name.startswith(OVERLAY_XATTR_PREFIX):
            if overlay_upper and name == OPAQUE_XATTR and value == b"y":
                opaque = True
            continue  # overlayfs bookkeeping is not content
        out[name] = value
    return out, opaque


def scan_dir(root: Path, *, overlay_upper: bool = False,
             on_entry: Callable[[Entry], None] | None = None) -> list[Scanned]:
    """Every path under root in sorted order. With overlay_upper, 0:0 character devices are
    whiteouts and ``trusted.overlay.opaque=y`` directories are opaque."""
    out: list[Scanned] = []
    seen_inodes: dict[tuple[int, int], str] = {}

    def visit(host: str, rel: str) -> None:
        st = os.lstat(host)
        mode = st.st_mode
        xattrs, opaque = _xattrs(host, overlay_upper)
        e = Entry(path=rel, type="reg", mode=stat.S_IMODE(mode), uid=st.st_uid, gid=st.st_gid,
                  mtime=st.st_mtime_ns, xattrs=xattrs)
        source = None
        if stat.S_ISDIR(mode):
            e.type, e.opaque = "dir", opaque
        elif stat.S_ISREG(mode):
            if st.st_nlink > 1:
                first = seen_inodes.setdefault((st.st_dev, st.st_ino), rel)
                if first != rel:
                    e.type, e.target = "hard", first
            if e.type == "reg":
                e.size, source = st.st_size, host
        elif stat.S_ISLNK(mode):
            e.type, e.target, e.xattrs = "sym", os.readlink(host), {}
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            if overlay_upper and stat.S_ISCHR(mode) and st.st_rdev == 0:
                e = Entry(path=rel, type="whiteout")
            else:
                e.type = "chr" if stat.S_ISCHR(mode) else "blk"
                e.rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        elif stat.S_ISFIFO(mode):
            e.type = "fifo"
        else:
            return  # sockets are not content
        out.append(Scanned(e, source, st.st_ctime_ns))
        if on_entry:
            on_entry(e)
        if e.type == "dir":
            with os.scandir(host) as it:
                names = sorted(d.name for d in it)
            for name in names:
                visit(os.path.join(host, name), name if rel == "." else f"{rel}/{name}")

    visit(str(root), ".")
    return out


class TreeWriter:
    """Writes entries under a destination directory, safely and with full metadata."""

    def __init__(self, dest: Path, *, overlay_form: bool, owners: bool | None = None) -> None:
        self.dest = dest
        self.overlay_form = overlay_form
        self.owners = os.geteuid() == 0 if owners is None else owners
        self._dirs: set[str] = {"."}
        self._dir_meta: list[Entry] = []
        dest.mkdir(parents=True, exist_ok=True)

    def _host(self, rel: str) -> str:
        return str(self.dest) if rel == "." else os.path.join(self.dest, rel)

    def _ensure_parent(self, rel: str) -> None:
        parent = parent_of(rel)
        if parent in self._dirs:
            return
        # a parent we did not create: each component must be a real directory, never a link
        cur = "."
        for part in parent.split("/"):
            cur = part if cur == "." else f"{cur}/{part}"
            if cur in self._dirs:
                continue
            try:
                st = os.lstat(self._host(cur))
            except FileNotFoundError:
                os.mkdir(self._host(cur), 0o755)
                self._dirs.add(cur)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise FormatError(f"refusing to write {rel!r}: {cur!r} is not a directory")
            self._dirs.add(cur)

    def _clear(self, host: str, keep_dir: bool) -> None:
        try:
            st = os.lstat(host)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            import shutil

            shutil.rmtree(host)
        else:
            os.unlink(host)

    def write(self, e: Entry, content: Iterable[bytes] | None = None) -> None:
        rel = check_rel_path(e.path)
        if rel != ".":
            self._ensure_parent(rel)
        host = self._host(rel)
        t = e.type
        if t == "dir":
            self._clear(host, keep_dir=True)
            if rel != ".":
                try:
                    os.mkdir(host, 0o700)
                except FileExistsError:
                    pass
            self._dirs.add(rel)
            if e.opaque and self.overlay_form:
                os.setxattr(host, OPAQUE_XATTR, b"y", follow_symlinks=False)
            self._dir_meta.append(e)
            return
        self._clear(host, keep_dir=False)
        if t == "whiteout":
            if self.overlay_form:
                os.mknod(host, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            return
        if t == "reg":
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb", buffering=0) as f:
                for piece in content or ():
                    f.write(piece)
        elif t == "sym":
            os.symlink(e.target, host)
        elif t == "hard":
            src = self._host(check_rel_path(e.target))
            if os.path.islink(src) and not os.path.lexists(src):
                raise FormatError(f"hardlink {rel!r} -> {e.target!r} has no target")
            os.link(src, host, follow_symlinks=False)
            return  # shares the target's inode and metadata
        elif t in ("chr", "blk"):
            kind = stat.S_IFCHR if t == "chr" else stat.S_IFBLK
            major, minor = e.rdev or (0, 0)
            os.mknod(host, kind | 0o600, os.makedev(major, minor))
        elif t == "fifo":
            os.mkfifo(host, 0o600)
        else:
            raise FormatError(f"cannot write entry type {t!r} at {rel!r}")
        self._meta(host, e)

    def _meta(self, host: str, e: Entry) -> None:
        is_link = e.type == "sym"
        if self.owners:
            os.lchown(host, e.uid, e.gid)
        for name, value in e.xattrs.items():
            try:
                os.setxattr(host, name, value, follow_symlinks=False)
            except OSError as err:
                if err.errno not in (errno.ENOTSUP, errno.EPERM):
                    raise
        if not is_link:
            os.chmod(host, e.mode)  # after chown, which clears setuid bits
        os.utime(host, ns=(e.mtime, e.mtime), follow_symlinks=False)

    def finish(self) -> None:
        """Directory metadata last, deepest first, so writing children does not touch mtimes."""
        for e in reversed(self._dir_meta):
            self._meta(self._host(e.path), e)
        self._dir_meta.clear()

