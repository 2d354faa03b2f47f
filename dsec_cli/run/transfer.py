"""`dsec cp`: files between the host and a sandbox (one side is ``SANDBOX:PATH``).

The sandbox side goes through the agent, which resolves the path inside the sandbox's own
root, so no path argument can reach the host's files. Both directions stream in 1 MiB
frames and skip holes, so a file's size costs disk, never memory.

Out of a sandbox, everything but the destination the user named comes from the sandbox and
is hostile: names inside a copied directory, symlink targets, modes, sizes. `HostTreeWriter`
writes it under a fresh temporary name beside the destination, through directory fds, never
following a symlink (O_NOFOLLOW, O_EXCL), accepting only plain names (no ``/``, ``.``,
``..``), and without setuid, setgid or sticky bits; the finished tree is renamed into place,
so a refused or failed copy leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..core.errors import DsecError, NotFoundError, UsageError
from .node import Node

if TYPE_CHECKING:
    from .cluster.remote import RemoteNode

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _split(arg: str) -> tuple[str | None, str]:
    head, sep, tail = arg.partition(":")
    if sep and head and "/" not in head and tail:
        return head, tail
    return None, arg


def copy(node: Node | RemoteNode, src: str, dst: str) -> dict[str, Any]:
    s_id, s_path = _split(src)
    d_id, d_path = _split(dst)
    if (s_id is None) == (d_id is None):
        raise UsageError("exactly one side of cp must be SANDBOX:PATH, e.g. "
                         "`dsec cp ./f.txt 1a2b3c:/tmp/f.txt`")
    if d_id is not None:
        return _copy_in(node, Path(s_path), d_id, d_path)
    assert s_id is not None
    return _copy_out(node, s_id, s_path, Path(d_path))


def _copy_in(node: Node | RemoteNode, host: Path, sid: str, path: str) -> dict[str, Any]:
    """Host -> sandbox: one regular file, streamed."""
    if not host.exists():
        raise NotFoundError(f"no such file on the host: {host}")
    if not host.is_file():
        raise UsageError(f"cannot copy {host} into a sandbox: only regular files can be")
    target = path + host.name if path.endswith("/") else path
    with open(host, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode & 0o7777
        if hasattr(node, "put_stream"):
            size = node.put_stream(sid, target, f, mode)
        else:  # a cluster node's service takes whole files
            data = f.read()
            node.put_file(sid, target, data, mode)
            size = len(data)
    return {"sandbox": node.lookup(sid).id, "to": target, "bytes": size}


def _copy_out(node: Node | RemoteNode, sid: str, path: str, dest: Path) -> dict[str, Any]:
    """Sandbox -> host: a file, symlink or directory, into DEST (or DEST/NAME when DEST is
    an existing directory)."""
    name = PurePosixPath(path).name
    if dest.is_dir() and name:
        dest = dest / name
    parent = dest.parent
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"cannot write into {parent}: {e.strerror}") from e
    writer = HostTreeWriter(parent_fd, f".{dest.name}.dsec-{secrets.token_hex(4)}", str(dest))
    try:
        if hasattr(node, "get_tree"):
            node.get_tree(sid, path, writer)
        else:  # a cluster node's service sends one regular file whole
            data, mode = node.get_file_with_mode(sid, path)
            writer.entry("f", mode, len(data), b"", b"")
            writer.chunk(0, memoryview(data))
        writer.commit(dest.name)
    except BaseException:
        writer.abort()
        raise
    finally:
        os.close(parent_fd)
    return {"sandbox": node.lookup(sid).id, "from": path, "to": str(dest),
            "bytes": writer.bytes, "entries": writer.entries}


class HostTreeWriter:
    """A `TreeSink` that writes what a sandbox sends under `tmp_name` in the directory
    `parent_fd`, safely (see the module docstring), then renames it into place."""

    def __init__(self, parent_fd: int, tmp_name: str, shown: str) -> None:
        self._parent, self._tmp, self._shown = parent_fd, tmp_name, shown
        self._root_fd = -1
        self._stack: list[tuple[bytes, int]] = []  # open dirs, root first (DFS order)
        self._file: tuple[int, int, int] | None = None  # fd, size, mode of the open file
        self._fix_modes: list[tuple[bytes, int]] = []  # dirs whose mode lacks u+rwx
        self._started = False
        self.bytes = 0
        self.entries = 0

    # -- TreeSink ------------------------------------------------------------------------------
    def entry(self, kind: str, mode: int, size: int, rel: bytes, target: bytes) -> None:
        self._close_file()
        self.entries += 1
        mode &= 0o777  # never setuid, setgid or sticky on the host
        if not rel:
            if self._started:
                raise self._bad("a second root entry")
            self._started = True
            self._make(self._parent, self._tmp.encode(), kind, mode, size, target, b"")
            return
        if not self._started or self._root_fd < 0:
            raise self._bad(f"{_show(rel)} outside a copied directory")
        parts = rel.split(b"/")
        if any(p in (b"", b".", b"..") or b"\0" in p for p in parts):
            raise self._bad(f"the name {_show(rel)}")
        self._make(self._dir_fd(b"/".join(parts[:-1])), parts[-1], kind, mode, size, target, rel)

    def chunk(self, offset: int, data: memoryview) -> None:
        if self._file is None:
            raise self._bad("file content without a file")
        fd, size, _ = self._file
        if offset < 0 or offset + len(data) > size:
            raise self._bad("file content past the file's size")
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n
            self.bytes += n

    # -- building ------------------------------------------------------------------------------
    def _make(self, dir_fd: int, name: bytes, kind: str, mode: int, size: int, target: bytes,
              rel: bytes) -> None:
        try:
            if kind == "f":
                fd = os.open(name, _CREATE_FILE, 0o600, dir_fd=dir_fd)
                self._file = (fd, size, mode)
            elif kind == "d":
                os.mkdir(name, 0o700, dir_fd=dir_fd)
                fd = os.open(name, _OPEN_DIR, dir_fd=dir_fd)
                os.fchmod(fd, mode | 0o700)  # writable until done; tightened at commit
                if mode & 0o700 != 0o700:
                    self._fix_modes.append((rel, mode))
                if not rel:
                    self._root_fd = fd
                self._stack.append((rel, fd))
            elif kind == "l":
                if not target or b"\0" in target:
                    raise self._bad(f"the symlink {_show(rel)}")
                os.symlink(target, name, dir_fd=dir_fd)
            else:
                raise self._bad(f"an entry of unknown kind {kind!r}")
        except FileExistsError as e:
            raise self._bad(f"{_show(rel)} twice") from e
        except OSError as e:
            raise self._host_error(e, rel) from e

    def _dir_fd(self, rel: bytes) -> int:
        """An fd of the copied directory `rel`, opened component by component without
        following symlinks (entries come parents first, so this is usually the top)."""
        while self._stack and not (rel == self._stack[-1][0]
                                   or self._stack[-1][0] == b""
                                   or rel.startswith(self._stack[-1][0] + b"/")):
            os.close(self._stack.pop()[1])
        base, fd = self._stack[-1] if self._stack else (b"", -1)
        if fd < 0:
            raise self._bad(f"{_show(rel)} outside a copied directory")
        rest = rel[len(base):].lstrip(b"/")
        for part in rest.split(b"/") if rest else []:
            try:
                fd = os.open(part, _OPEN_DIR, dir_fd=fd)
            except OSError as e:  # a symlink or a file where a directory should be
                raise self._bad(f"{_show(rel)} below something that is not a directory") from e
            base = base + b"/" + part if base else part
            self._stack.append((base, fd))
        return fd

    def _close_file(self) -> None:
        if self._file is None:
            return
        fd, size, mode = self._file
        self._file = None
        try:
            os.ftruncate(fd, size)  # trailing holes, and a file that shrank while sent
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    # -- finishing -----------------------------------------------------------------------------
    def commit(self, final: str) -> None:
        if not self._started:
            raise self._bad("nothing")
        self._close_file()
        for rel, mode in sorted(self._fix_modes, key=lambda rm: -rm[0].count(b"/")):
            fd = self._dir_fd(rel) if rel else self._root_fd
            os.fchmod(fd, mode)
        self._close_dirs()
        try:
            os.replace(self._tmp, final, src_dir_fd=self._parent, dst_dir_fd=self._parent)
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                kind = "is not a directory" if e.errno == errno.ENOTDIR else "is a directory"
                raise UsageError(f"cannot copy to {self._shown}: it exists and {kind}",
                                 hint="remove it first, or name a new path") from e
            raise self._host_error(e, b"") from e

    def abort(self) -> None:
        if self._file is not None:
            os.close(self._file[0])
            self._file = None
        self._close_dirs()
        if not self._started:
            return
        try:
            st = os.stat(self._tmp, dir_fd=self._parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(self._tmp, dir_fd=self._parent)  # fd-based, follows no link
            else:
                os.unlink(self._tmp, dir_fd=self._parent)
        except OSError:
            pass

    def _close_dirs(self) -> None:
        while self._stack:
            fd = self._stack.pop()[1]
            if fd != self._root_fd:
                os.close(fd)
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def _bad(self, what: str) -> DsecError:
        return UsageError(f"refusing to copy to {self._shown}: the sandbox sent {what}")

    def _host_error(self, e: OSError, rel: bytes) -> DsecError:
        where = f"{self._shown}/{_show(rel)}" if rel else self._shown
        return UsageError(f"cannot write {where}: {e.strerror or e}")


def _show(rel: bytes) -> str:
    return repr(rel.decode(errors="backslashreplace"))[1:-1]
