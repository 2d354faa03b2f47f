"""Trees on a real filesystem: scanning a directory into index entries, and writing
entries back out (as a plain tree, or in overlayfs form with whiteouts as 0:0 devices).

`TreeWriter` is the one code path that writes a layer's files anywhere (exports, the node's
layer cache, build staging, extract steps). Its entries are hostile input, so it never
resolves a path through a symlink or out of its root: every parent directory is opened
beneath the root with openat2(2) and RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV (or, where the kernel lacks openat2, by a walk of
O_NOFOLLOW | O_DIRECTORY opens, one component at a time), and the final name is created,
linked, chowned, chmodded and timestamped through that directory's fd. Entries are applied in
order with overlay's rule: a later entry for the same path replaces the earlier one (a
directory replaced by a non-directory loses its children); an entry below a path that is not
a directory is an error, never resolved through a link.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.config import env
from ..core.errors import FormatError
from .index import Entry
from .layout import OPAQUE_XATTR, OVERLAY_XATTR_PREFIX, check_rel_path

log = logging.getLogger(__name__)

def parent_of(path: str) -> str:
    head = path.rpartition("/")[0]
    return head or "."


def _split(rel: str) -> tuple[str, str]:
    head, _, name = rel.rpartition("/")
    return head or ".", name


# -- resolving beneath a root ------------------------------------------------------------------

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall unification)
_RESOLVE = 0x08 | 0x04 | 0x02 | 0x01  # BENEATH | NO_SYMLINKS | NO_MAGICLINKS | NO_XDEV
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: the deepest tree a layer can hold: paths are at most 4096 bytes (format/validate.py), so
#: one-byte names nest at most this far; a walk goes this deep and refuses a deeper tree
MAX_DEPTH = 2048


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
#: cleared the first time the kernel refuses openat2 (or by tests, to exercise the walk)
use_openat2 = True


def _openat2(dirfd: int, rel: str, flags: int) -> int:
    how = _OpenHow(flags, 0, _RESOLVE)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd),
                  ctypes.c_char_p(os.fsencode(rel)), ctypes.byref(how),
                  ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return int(fd)


def _walk(root_fd: int, rel: str, create: bool) -> int:
    """The directory ``rel`` beneath root_fd, one O_NOFOLLOW | O_DIRECTORY open per component
    (each step names one entry of a directory already proven to be beneath the root, so no
    symlink and no `..` is ever followed); missing components are made with mode 0755."""
    root_dev = os.fstat(root_fd).st_dev
    fd = os.dup(root_fd)
    try:
        for part in rel.split("/"):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made concurrently: opened (and checked) below
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if os.fstat(fd).st_dev != root_dev:
                raise OSError(errno.EXDEV, "crosses a mount point", rel)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir_beneath(root_fd: int, rel: str, *, create: bool = False) -> int:
    """An fd of directory ``rel`` (relative, normalized) beneath root_fd, never reached
    through a symlink, a magic link, `..` or a mount point. With create, missing directories
    are made. Raises FileNotFoundError, or FormatError when a component is not a directory."""
    global use_openat2
    if rel == ".":
        return os.dup(root_fd)
    try:
        if use_openat2:
            try:
                return _openat2(root_fd, rel, _DIR_FLAGS)
            except OSError as e:
                if e.errno in (errno.ENOSYS, errno.EPERM):
                    # EPERM: seccomp profiles that predate openat2 refuse it that way
                    use_openat2 = False
                elif e.errno == errno.ENOENT and create:
                    pass  # the walk makes what is missing
                elif e.errno != errno.EAGAIN:  # EAGAIN: a concurrent rename; walk instead
                    raise
        return _walk(root_fd, rel, create)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
            raise FormatError(f"refusing to write below {rel!r}: a component of it is not a "
                              "directory of the tree (a symlink, a file or a mount)") from e
        raise


def last_wins(entries: list[Entry]) -> tuple[list[int], list[str]]:
    """The positions of the entries a tree shows, in index order, by the rule the writer
    applies: a later entry for a path replaces the earlier one, a directory replaced by a
    non-directory loses what was below it, and an entry whose parent is not (yet) a
    directory is dropped, never resolved through a link; as is a hardlink whose target is
    not a shown regular file. Returns (positions, dropped paths)."""
    win: dict[str, int] = {}
    kids: dict[str, list[str]] = {}
    dropped: list[str] = []

    def forget_below(path: str) -> None:
        stack = kids.pop(path, [])
        while stack:
            p = stack.pop()
            if win.pop(p, None) is not None:
                stack.extend(kids.pop(p, []))

    for i, e in enumerate(entries):
        p = e.path
        if p != ".":
            parent = parent_of(p)
            pi = win.get(parent)
            if pi is None or entries[pi].type != "dir":
                dropped.append(p)
                continue
        prev = win.get(p)
        if prev is not None:
            if entries[prev].type == "dir" and e.type != "dir":
                forget_below(p)
        elif p != ".":
            kids.setdefault(parent_of(p), []).append(p)
        win[p] = i
    shown = sorted(win.values())
    out = []
    for i in shown:
        e = entries[i]
        if e.type == "hard":
            ti = win.get(e.target)
            if ti is None or entries[ti].type != "reg":
                dropped.append(e.path)
                continue
        out.append(i)
    return out, dropped


# -- scanning ----------------------------------------------------------------------------------

#: what a snapshot keeps of the special files a sandbox left in its upper directory
SNAPSHOT_POLICY = (
    "overlay whiteouts (0:0 character devices) become whiteouts; other device nodes are "
    "dropped; sockets are dropped; FIFOs are kept; setuid and setgid bits and "
    "security.capability xattrs are removed"
)


@dataclass
class Scanned:
    entry: Entry
    source: str | None  # host path holding a regular file's bytes
    ctime: int = 0  # change time (ns) of the host path, to tell what a step touched


@dataclass
class ScanReport:
    """What a scan left out or changed, for the user to see (snapshots)."""

    dropped: list[str] = field(default_factory=list)  # "path: why"
    changed: list[str] = field(default_factory=list)

    def warnings(self) -> list[str]:
        return [f"dropped {d}" for d in self.dropped] + [f"changed {c}" for c in self.changed]


#: one path of a walk, as the compiled walker and its pure-Python twin both give it:
#: (rel, st_mode, uid, gid, mtime_ns, size, nlink, dev, ino, rdev_major, rdev_minor,
#:  ctime_ns, symlink target or None, [(xattr name, value)] or None)
Record = tuple[str, int, int, int, int, int, int, int, int, int, int, int, "str | None",
               "list[tuple[str, bytes]] | None"]

try:  # built by setup.py; without it the pure-Python walk below gives the same records
    from . import _walk as _cwalk  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _cwalk = None
#: cleared when the compiled walker is not built, by DSEC_PY_WALK, or by tests comparing both
use_compiled = _cwalk is not None and not env("DSEC_PY_WALK")


def _py_xattrs(dfd: int, name: str, fd: int | None) -> list[tuple[str, bytes]]:
    # an open fd where there is one; else the name through the parent's fd (no symlink:
    # xattrs are never read from symlinks)
    target: int | str = fd if fd is not None else f"/proc/self/fd/{dfd}/{name}"
    try:
        names = os.listxattr(target, follow_symlinks=False) if fd is None \
            else os.listxattr(target)
    except OSError:
        return []
    out: list[tuple[str, bytes]] = []
    for xname in names:
        try:
            value = os.getxattr(target, xname, follow_symlinks=False) if fd is None \
                else os.getxattr(target, xname)
        except OSError:
            continue
        out.append((xname, value))
    return out


def _py_records(root: str, xattrs: bool = True) -> list[Record]:
    """The records of every path under root in sorted pre-order, never following a symlink
    below root (each directory is opened with O_NOFOLLOW through its parent's fd)."""
    out: list[Record] = []

    def emit(dfd: int, name: str, rel: str, st: os.stat_result, sub_fd: int | None) -> None:
        mode = st.st_mode
        target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(mode) else None
        xs = None if target is not None or not xattrs else _py_xattrs(dfd, name, sub_fd)
        out.append((rel, mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size, st.st_nlink,
                    st.st_dev, st.st_ino, os.major(st.st_rdev), os.minor(st.st_rdev),
                    st.st_ctime_ns, target, xs))
        if sub_fd is not None:
            for child in sorted(os.listdir(sub_fd)):
                visit(sub_fd, child, child if rel == "." else f"{rel}/{child}")

    def visit(dfd: int, name: str, rel: str) -> None:
        st = os.lstat(name, dir_fd=dfd)
        sub_fd: int | None = None
        if stat.S_ISDIR(st.st_mode):
            sub_fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
        try:
            emit(dfd, name, rel, st, sub_fd)
        finally:
            if sub_fd is not None:
                os.close(sub_fd)

    # the root is the caller's own path (a spec's folder may be a symlink); below it nothing
    # is followed
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        emit(root_fd, ".", ".", os.fstat(root_fd), root_fd)
    finally:
        os.close(root_fd)
    return out


def walk_records(root: str, *, xattrs: bool = True) -> list[Record]:
    """Every path under root as a `Record`, in sorted pre-order, never following a symlink
    below root: from the compiled walker where it is built, else from Python."""
    # both walks stop at the interpreter's recursion limit: raised for the walk to the
    # depth a layer can hold, so a tree a sandbox nested past it is an error, not a crash
    limit = sys.getrecursionlimit()
    if limit < 2 * MAX_DEPTH + 200:  # the Python walk takes two frames a level
        sys.setrecursionlimit(2 * MAX_DEPTH + 200)
    try:
        if use_compiled and _cwalk is not None:
            return _cwalk.scan(root, xattrs)  # type: ignore[no-any-return]
        return _py_records(root, xattrs)
    except RecursionError as e:
        raise FormatError(f"{root}: the tree is nested deeper than a layer can hold "
                          f"(paths of at most 4096 bytes, {MAX_DEPTH} levels)") from e
    finally:
        sys.setrecursionlimit(limit)


def _py_stat_listing(root: str) -> bytes:
    """The pure-Python twin of the compiled ``stat_listing``."""
    def line(rel: bytes, st: os.stat_result) -> bytes:
        return b"%s\0%d\0%d\0%d\0%d\0%d\n" % (rel, st.st_size, st.st_mtime_ns,
                                                  st.st_ctime_ns, st.st_mode, st.st_ino)

    out: list[bytes] = []

    def listdir(fd: int, rel: bytes) -> None:
        for name in sorted(os.fsencode(n) for n in os.listdir(fd)):
            r = rel + b"/" + name if rel else name
            st = os.lstat(name, dir_fd=fd)
            out.append(line(r, st))
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    listdir(sub, r)
                finally:
                    os.close(sub)

    st = os.stat(root)
    out.append(line(b".", st))
    if stat.S_ISDIR(st.st_mode):
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            listdir(fd, b"")
        finally:
            os.close(fd)
    return b"".join(out)


def stat_listing(root: str) -> bytes:
    """What a build's cache key knows of a source tree without reading a file: one line per
    path (pre-order, names sorted as bytes) with its size, mtime, ctime, mode and inode,
    never following a symlink below root (root itself is followed). Any write to a file
    changes its mtime and ctime, a chmod, chown or xattr change its ctime, and an added,
    removed or renamed path changes the lines, so a changed input is always seen as long as
    the filesystem keeps ctime (every Linux filesystem does; ctime cannot be set by
    utimensat)."""
    # (a module built from an older _walk.c has no stat_listing: the Python twin gives the
    # same bytes)
    if use_compiled and _cwalk is not None and hasattr(_cwalk, "stat_listing"):
        return _cwalk.stat_listing(root)  # type: ignore[no-any-return]
    return _py_stat_listing(root)


def _py_read_many(paths: list[str], limit: int) -> list[tuple[int, bytes | None]]:
    out: list[tuple[int, bytes | None]] = []
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            data = None
            if 0 < size <= limit:
                parts = [os.read(fd, size)]
                have = len(parts[0])
                while have < size and (piece := os.read(fd, size - have)):  # short reads
                    parts.append(piece)
                    have += len(piece)
                data = parts[0] if len(parts) == 1 else b"".join(parts)
            out.append((size, data))
        finally:
            os.close(fd)
    return out


def read_many(paths: list[str], limit: int) -> list[tuple[int, bytes | None]]:
    """(size, bytes) of each file, opened by path: its size as fstat gives it and, when
    0 < size <= limit, its bytes (fewer when it shrinks meanwhile; None otherwise). The
    compiled reader releases the GIL for the whole batch."""
    if use_compiled and _cwalk is not None:
        return _cwalk.read_many(paths, limit)  # type: ignore[no-any-return]
    return _py_read_many(paths, limit)


_S_IFMT = 0o170000


def scan_dir(root: Path, *, overlay_upper: bool = False,
             on_entry: Callable[[Entry], None] | None = None,
             snapshot: ScanReport | None = None) -> list[Scanned]:
    """Every path under root in sorted order, never following a symlink (each directory is
    opened with O_NOFOLLOW through its parent's fd). With overlay_upper, 0:0 character
    devices are whiteouts and ``trusted.overlay.opaque=y`` directories are opaque. With a
    snapshot report, `SNAPSHOT_POLICY` applies and what it dropped or changed is recorded."""
    out: list[Scanned] = []
    seen_inodes: dict[tuple[int, int], str] = {}
    root_str = str(root)
    prefix = root_str if root_str.endswith("/") else root_str + "/"  # os.path.join's result
    for rec in walk_records(root_str):
        (rel, mode, uid, gid, mtime, size, nlink, dev, ino, rmaj, rmin, ctime, target,
         raw_xattrs) = rec
        xattrs: dict[str, bytes] = {}
        opaque = False
        if raw_xattrs:  # most paths have none: skip the loop
            for xname, value in raw_xattrs:
                if xname.startswith(OVERLAY_XATTR_PREFIX):
                    if overlay_upper and xname == OPAQUE_XATTR and value == b"y":
                        opaque = True
                    continue  # overlayfs bookkeeping is not content
                xattrs[xname] = value
        perm = mode & 0o7777
        fmt = mode & _S_IFMT
        if snapshot is not None:
            if perm & (stat.S_ISUID | stat.S_ISGID) and fmt != stat.S_IFDIR:
                perm &= ~(stat.S_ISUID | stat.S_ISGID)
                snapshot.changed.append(f"{rel}: setuid/setgid bits removed")
            if xattrs.pop("security.capability", None) is not None:
                snapshot.changed.append(f"{rel}: file capabilities removed")
        source = None
        if fmt == stat.S_IFREG:
            e = Entry(rel, "reg", perm, uid, gid, mtime, 0, "", None, xattrs)
            if nlink > 1:
                first = seen_inodes.setdefault((dev, ino), rel)
                if first != rel:
                    e.type, e.target = "hard", first
            if e.type == "reg":
                e.size, source = size, root_str if rel == "." else prefix + rel
        elif fmt == stat.S_IFDIR:
            e = Entry(rel, "dir", perm, uid, gid, mtime, 0, "", None, xattrs, opaque)
        elif target is not None:
            e = Entry(rel, "sym", perm, uid, gid, mtime, 0, target)
        elif fmt == stat.S_IFCHR or fmt == stat.S_IFBLK:
            if overlay_upper and fmt == stat.S_IFCHR and rmaj == 0 and rmin == 0:
                e = Entry(path=rel, type="whiteout")
            elif snapshot is not None:
                snapshot.dropped.append(f"{rel}: device node")
                continue
            else:
                e = Entry(rel, "chr" if fmt == stat.S_IFCHR else "blk", perm, uid, gid, mtime,
                          0, "", (rmaj, rmin), xattrs)
        elif fmt == stat.S_IFIFO:
            e = Entry(rel, "fifo", perm, uid, gid, mtime, 0, "", None, xattrs)
        else:
            if snapshot is not None:
                snapshot.dropped.append(f"{rel}: socket")
            continue  # sockets are not content
        out.append(Scanned(e, source, ctime))
        if on_entry:
            on_entry(e)
    return out


# -- writing -----------------------------------------------------------------------------------


class TreeWriter:
    """Writes entries under a destination directory, safely and with full metadata.

    Use as a context manager (or call `finish` / `close`): it holds directory fds."""

    def __init__(self, dest: Path, *, overlay_form: bool, owners: bool | None = None) -> None:
        self.dest = dest
        self.overlay_form = overlay_form
        self.owners = os.geteuid() == 0 if owners is None else owners
        self._dir_meta: dict[str, Entry] = {}
        dest.mkdir(parents=True, exist_ok=True)
        self._root = os.open(dest, _DIR_FLAGS)
        # the fd of the parent of the last entry: sorted trees write many entries into one
        # directory in a row. It cannot go stale: the only mutations are of the *children* of
        # the directory an entry is written into, and an entry whose path is this directory
        # itself has a different parent, so the cache moves away before it is replaced.
        self._pdir: str | None = None
        self._pfd = -1

    def __enter__(self) -> TreeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._drop_cache()
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def _drop_cache(self) -> None:
        if self._pfd >= 0:
            os.close(self._pfd)
        self._pdir, self._pfd = None, -1

    def _parent_fd(self, parent: str) -> int:
        if self._pdir != parent:
            self._drop_cache()
            self._pfd = open_dir_beneath(self._root, parent, create=True)
            self._pdir = parent
        return self._pfd

    def _remove(self, dfd: int, name: str, rel: str) -> None:
        """Remove whatever is at name (a whole tree for a directory: rmtree with dir_fd
        never follows a symlink) and forget the bookkeeping of what was below it."""
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)
            prefix = rel + "/"
            self._dir_meta.pop(rel, None)
            for p in [p for p in self._dir_meta if p.startswith(prefix)]:
                del self._dir_meta[p]
        else:
            os.unlink(name, dir_fd=dfd)

    def write(self, e: Entry, content: Iterable[bytes] | None = None) -> None:
        rel = check_rel_path(e.path)
        t = e.type
        if rel == ".":
            if t != "dir":
                raise FormatError(f"the root of a tree must be a directory, not {t!r}")
            self._dir(self._root, None, rel, e)
            return
        parent, name = _split(rel)
        dfd = self._parent_fd(parent)
        if t == "dir":
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(name, dir_fd=dfd).st_mode):
                    self._remove(dfd, name, rel)
                    os.mkdir(name, 0o700, dir_fd=dfd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                self._dir(fd, name, rel, e)
            finally:
                os.close(fd)
            return
        if t == "whiteout":
            self._remove(dfd, name, rel)
            if self.overlay_form:
                os.mknod(name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=dfd)
            return
        if t == "reg":
            self._reg(dfd, name, rel, e, content)
            return
        if t not in ("sym", "hard", "chr", "blk", "fifo"):
            raise FormatError(f"cannot write entry type {t!r} at {rel!r}")
        try:
            self._create(dfd, name, e)
        except FileExistsError:
            self._remove(dfd, name, rel)
            self._create(dfd, name, e)
        if t != "hard":  # a hardlink shares the target's inode and metadata
            self._meta_at(dfd, name, e)

    def _dir(self, fd: int, name: str | None, rel: str, e: Entry) -> None:
        if e.opaque and self.overlay_form:
            os.setxattr(fd, OPAQUE_XATTR, b"y")
        self._dir_meta[rel] = e  # applied by finish, after the children are written

    def _reg(self, dfd: int, name: str, rel: str, e: Entry,
             content: Iterable[bytes] | None) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            self._remove(dfd, name, rel)
            fd = os.open(name, flags, 0o600, dir_fd=dfd)
        try:
            for piece in content or ():
                view = memoryview(piece)
                while view:  # a write may be short
                    view = view[os.write(fd, view):]
            self._meta_fd(fd, e)
        finally:
            os.close(fd)

    def _create(self, dfd: int, name: str, e: Entry) -> None:
        t = e.type
        if t == "sym":
            os.symlink(e.target, name, dir_fd=dfd)
        elif t == "hard":
            self._link(dfd, name, e)
        elif t in ("chr", "blk"):
            kind = stat.S_IFCHR if t == "chr" else stat.S_IFBLK
            major, minor = e.rdev or (0, 0)
            os.mknod(name, kind | 0o600, os.makedev(major, minor), dir_fd=dfd)
        else:
            os.mkfifo(name, 0o600, dir_fd=dfd)

    def _link(self, dfd: int, name: str, e: Entry) -> None:
        """A hardlink's source is resolved beneath the root like any parent: an absolute or
        `..` target, or one reached through a symlink, is an error."""
        try:
            target = check_rel_path(e.target)
        except FormatError as err:
            raise FormatError(f"hardlink {e.path!r} -> {e.target!r}: {err}") from err
        if target == ".":
            raise FormatError(f"hardlink {e.path!r} points at the root")
        tparent, tname = _split(target)
        try:
            tfd = open_dir_beneath(self._root, tparent)
        except FileNotFoundError:
            raise FormatError(f"hardlink {e.path!r} -> {e.target!r} has no target") from None
        try:
            st = os.lstat(tname, dir_fd=tfd)
            if stat.S_ISDIR(st.st_mode):
                raise FormatError(f"hardlink {e.path!r} -> {e.target!r} points at a directory")
            os.link(tname, name, src_dir_fd=tfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise FormatError(f"hardlink {e.path!r} -> {e.target!r} has no target") from None
        finally:
            os.close(tfd)

    def _set_xattrs(self, target: int | str, e: Entry) -> None:
        """An entry's xattrs on its file (an fd, or a /proc/self/fd path not followed).

        overlayfs's own xattrs (redirects, metacopy, ...) never come from an index: the
        writer sets the opaque marker itself. A name this host does not let the writer set
        (an unprivileged export, a filesystem without it) is skipped; a value the kernel
        refuses is an error naming the path, never a traceback."""
        for name, value in e.xattrs.items():
            if name.startswith(OVERLAY_XATTR_PREFIX):
                continue
            try:
                os.setxattr(target, name, value, follow_symlinks=isinstance(target, int))
            except OSError as err:
                if err.errno in (errno.ENOTSUP, errno.EPERM):
                    continue
                raise FormatError(f"cannot set xattr {name!r} on {e.path!r}: "
                                  f"{err.strerror}") from None

    def _meta_fd(self, fd: int, e: Entry) -> None:
        """Metadata of a file or directory through its own open fd."""
        if self.owners:
            os.fchown(fd, e.uid, e.gid)
        self._set_xattrs(fd, e)
        os.fchmod(fd, e.mode & 0o7777)  # after chown, which clears setuid bits
        os.utime(fd, ns=(e.mtime, e.mtime))

    def _meta_at(self, dfd: int, name: str, e: Entry) -> None:
        """Metadata of a symlink, device or FIFO (never opened: opening one has effects)
        through its parent's fd, not following the final name."""
        if self.owners:
            os.chown(name, e.uid, e.gid, dir_fd=dfd, follow_symlinks=False)
        if e.type != "sym":  # symlinks carry no mode, and Linux allows no user xattrs on them
            self._set_xattrs(f"/proc/self/fd/{dfd}/{name}", e)
            os.chmod(name, e.mode & 0o7777, dir_fd=dfd, follow_symlinks=False)
        os.utime(name, ns=(e.mtime, e.mtime), dir_fd=dfd, follow_symlinks=False)

    def finish(self) -> None:
        """Directory metadata last, deepest first, so writing children does not touch mtimes."""
        self._drop_cache()
        for rel in sorted(self._dir_meta, reverse=True):
            fd = open_dir_beneath(self._root, rel)
            try:
                self._meta_fd(fd, self._dir_meta[rel])
            finally:
                os.close(fd)
        self._dir_meta.clear()
        self.close()
