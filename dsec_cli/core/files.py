"""Small file-system steps shared across layers."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path | str, missing_ok: bool = False) -> None:
    """Make a file's data durable (open it read-only and fsync); with ``missing_ok``, a file
    that is gone is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- trees another party made ----------------------------------------------------------------
#: directory fds a walk keeps open at most; a level closed to stay within it is reopened
#: through ".." and must have the device and inode first seen there
WALK_OPEN_DIRS = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_DIR = (errno.ENOTDIR, errno.ELOOP)


class _Level:
    """One directory of a walk: its name in its parent, its identity, its fd (None while
    closed) and the subdirectories still to visit."""

    __slots__ = ("name", "ident", "fd", "pending")

    def __init__(self, name: str, fd: int) -> None:
        st = os.fstat(fd)
        self.fd: int | None = fd
        self.name, self.ident = name, (st.st_dev, st.st_ino)
        self.pending: list[str] = []


def walk_tree(path: Path | str) -> Iterator[tuple[int, str, bool]]:
    """Every name below and including ``path`` as ``(dir_fd, name, is_dir)``, a directory
    after everything in it; act on a name only through ``dir_fd``, which stays valid until
    the next item. Written for trees a sandbox or a store writer made: iterative (no
    recursion however deep), fd-relative (no path longer than one name), never follows a
    symlink, never enters another filesystem, and holds at most `WALK_OPEN_DIRS` fds."""
    path = Path(path)
    top = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(path.name, _DIR_FLAGS, dir_fd=top)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in _NOT_A_DIR:
                raise
            yield top, path.name, False
            return
        stack = [_Level(path.name, fd)]
        try:
            yield from _walk_levels(stack)
        finally:
            for lv in stack:
                if lv.fd is not None:
                    os.close(lv.fd)
        yield top, path.name, True
    finally:
        os.close(top)


def _walk_levels(stack: list[_Level]) -> Iterator[tuple[int, str, bool]]:
    """Below ``stack``'s one level, leaving it in place (its caller yields it)."""
    dev = stack[0].ident[0]
    yield from _enter(stack[-1])
    while True:
        lv = stack[-1]
        assert lv.fd is not None
        if lv.pending:
            name = lv.pending.pop()
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=lv.fd)
            except FileNotFoundError:
                continue
            except OSError as e:  # replaced by a non-directory since it was listed
                if e.errno not in _NOT_A_DIR:
                    raise
                yield lv.fd, name, False
                continue
            child = _Level(name, fd)
            if child.ident[0] != dev:  # a mount point: not this walk's to enter
                os.close(fd)
                continue
            stack.append(child)
            opened = [x for x in stack if x.fd is not None]
            if len(opened) > WALK_OPEN_DIRS:
                os.close(opened[0].fd)  # type: ignore[arg-type]
                opened[0].fd = None
            yield from _enter(child)
            continue
        if len(stack) == 1:
            return
        stack.pop()
        parent = stack[-1]
        if parent.fd is None:
            parent.fd = _reopen_parent(lv.fd, parent.ident)
        os.close(lv.fd)
        lv.fd = None
        yield parent.fd, lv.name, True


def _enter(lv: _Level) -> Iterator[tuple[int, str, bool]]:
    """A level's non-directories; its subdirectories become its pending list."""
    assert lv.fd is not None
    with os.scandir(lv.fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    lv.pending = [n for n, is_dir in entries if is_dir]
    for n, is_dir in entries:
        if not is_dir:
            yield lv.fd, n, False


def _reopen_parent(child_fd: int, ident: tuple[int, int]) -> int:
    fd = os.open("..", _DIR_FLAGS, dir_fd=child_fd)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != ident:
        os.close(fd)
        raise OSError(errno.ESTALE, "a directory moved while its tree was walked")
    return fd


def remove_tree(path: Path | str) -> None:
    """rm -rf through `walk_tree`: safe on a tree its maker meant to hurt (any depth, any
    symlinks, nothing outside it touched). What cannot be removed (a mount point, a name
    that vanished or changed meanwhile) is left, as ``shutil.rmtree(ignore_errors=True)``
    leaves it."""
    try:
        for dfd, name, is_dir in walk_tree(path):
            try:
                if is_dir:
                    os.rmdir(name, dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)
            except OSError:
                continue
    except OSError:
        return


def tree_size(path: Path | str) -> int:
    """Bytes of the regular files in a tree, walked as `walk_tree` walks (links not
    followed, each hard-linked file counted at each of its names)."""
    total = 0
    for dfd, name, is_dir in walk_tree(path):
        if is_dir:
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


@contextmanager
def unix_address(path: str | Path) -> Iterator[str]:
    """An address to bind or connect a unix socket at ``path``, whatever its length:
    sun_path holds 108 bytes, so a longer path is reached through an O_PATH descriptor of
    its directory, open while the block runs."""
    path = str(path)
    if len(path.encode()) <= 100:
        yield path
        return
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}"
    finally:
        os.close(dir_fd)
