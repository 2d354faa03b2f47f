"""The FUSE filesystem of a lazy mount: the trees of one or more layers, read-only, served from
their indexes at once (every lookup, stat and listing is answered from memory) while file
bytes come from the layer's `LayerSource` on first read.

The mount root holds one directory per layer (``0``, ``1``, ... bottom first), each in
overlayfs lower form: whiteouts are 0:0 character devices and opaque directories carry
``trusted.overlay.opaque=y``, so each can be an overlay lower dir as it is. Hardlinks share
an inode number. Kernel page cache and attribute caching are switched on by the mount options
(see mountd.py), so a second read of the same bytes never reaches Python.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

from ...format.index import Entry, LayerIndex
from ...format.tree import OPAQUE_XATTR, OVERLAY_XATTR_PREFIX, last_wins
from .source import LayerSource

log = logging.getLogger(__name__)

_KIND = {"reg": stat.S_IFREG, "dir": stat.S_IFDIR, "sym": stat.S_IFLNK, "chr": stat.S_IFCHR,
         "blk": stat.S_IFBLK, "fifo": stat.S_IFIFO, "whiteout": stat.S_IFCHR}


@dataclass
class Node:
    layer: int
    entry: Entry  # for a hardlink, the group's first member (the one with the bytes)
    ino: int
    nlink: int
    children: list[str] | None = None
    _attrs: dict[str, Any] | None = None

    @property
    def attrs(self) -> dict[str, Any]:
        if self._attrs is None:  # made on first stat: most of a big tree is never looked at
            self._attrs = _attrs(self.entry, self.ino, self.nlink)
        return self._attrs


class Recorder:
    """The files a mount's readers touched first, in order, within a time window after the
    mount started: the profile `dsec optimize` turns into prefetch lists."""

    def __init__(self, layers: int, window: float) -> None:
        self.started = time.monotonic()
        self.window = window
        self.files: list[dict[str, float]] = [{} for _ in range(layers)]
        self._lock = threading.Lock()
        #: brings in touches counted elsewhere (first opens the compiled FUSE loop answered)
        self.pull: Any = None

    def collect(self) -> list[dict[str, float]]:
        """The files touched so far, per layer (path -> seconds after the mount started)."""
        if self.pull is not None:
            self.pull()
        return self.files

    def touch(self, layer: int, path: str, at: float | None = None) -> None:
        """``path`` was opened now, or at monotonic time ``at``."""
        t = (time.monotonic() if at is None else at) - self.started
        if t > self.window or path in self.files[layer]:
            return
        with self._lock:
            self.files[layer].setdefault(path, round(t, 4))


class LazyFS:
    """mfusepy Operations over layer indexes (path-based high-level FUSE API)."""

    use_ns = True

    def __init__(self, indexes: list[LayerIndex], sources: list[LayerSource],
                 recorder: Recorder | None = None, on_init: Any = None) -> None:
        self.sources = sources
        self.recorder = recorder
        self.on_init = on_init
        self.nodes: dict[str, Node] = {}
        now = time.time_ns()
        root = Node(-1, Entry(".", "dir", mode=0o755, mtime=now), 1, 2 + len(indexes),
                    [str(n) for n in range(len(indexes))])
        self.nodes["/"] = root
        base = 2
        for n, index in enumerate(indexes):
            self._add_layer(n, index, base)
            base += len(index.entries)

    def _add_layer(self, n: int, index: LayerIndex, base: int) -> None:
        """One node per shown entry; inode numbers are base + the entry's position (a
        hardlink takes its group's first member's), so they are stable for the mount's life.

        An index is hostile input: duplicates are resolved last-wins and entries below a
        non-directory are not shown (`last_wins`), so no path is ever served through a
        link, and a directory lists each name once."""
        entries = index.entries
        shown, dropped = last_wins(entries)
        if dropped:
            log.warning("lazy mount: layer %d: %d entries below a non-directory or with no "
                        "target are not shown (first: %r)", n, len(dropped), dropped[0])
        pos = {entries[i].path: i for i in shown}
        links: dict[str, int] = {}
        for i in shown:
            e = entries[i]
            if e.type == "hard":
                links[e.target] = links.get(e.target, 1) + 1
        nodes = self.nodes
        prefix = f"/{n}"
        for i in shown:
            e = entries[i]
            key = prefix if e.path == "." else f"{prefix}/{e.path}"
            if e.type == "hard":
                j = pos[e.target]
                node = Node(n, entries[j], base + j, links.get(e.target, 1))
            elif e.type == "dir":
                node = Node(n, e, base + i, 2, [])
            else:
                node = Node(n, e, base + i, links.get(e.path, 1) if e.type == "reg" else 1)
            nodes[key] = node
            if e.path != ".":
                parent, _, name = key.rpartition("/")
                pnode = nodes[parent]  # last_wins shows a parent directory before its child
                assert pnode.children is not None
                pnode.children.append(name)
                if node.children is not None:
                    pnode.nlink += 1

    def _node(self, path: str) -> Node:
        node = self.nodes.get(path)
        if node is None:
            raise _err(errno.ENOENT)
        return node

    # -- mfusepy operations --------------------------------------------------------------------
    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is not None:
            config.use_ino = 1  # hardlinks show one inode number
        if self.on_init is not None:
            self.on_init()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        return self._node(path).attrs

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        node = self._node(path)
        if node.children is None:
            raise _err(errno.ENOTDIR)
        # real inode numbers: a dirent with inode 0 is skipped by readers
        base = "" if path == "/" else path
        out = [(".", node.attrs, 0), ("..", node.attrs, 0)]
        out += [(name, self.nodes[f"{base}/{name}"].attrs, 0) for name in node.children]
        return out

    def readlink(self, path: str) -> str:
        node = self._node(path)
        if node.entry.type != "sym":
            raise _err(errno.EINVAL)
        return node.entry.target

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        node = self._node(path)
        if self.recorder is not None:
            self.recorder.touch(node.layer, node.entry.path)
        try:
            return self.sources[node.layer].read(node.entry, offset, size)
        except Exception as e:
            log.error("lazy mount: reading %s (layer %d, %d bytes at %d) failed: %s",
                      node.entry.path, node.layer, size, offset, e)
            raise _err(errno.EIO) from e

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        val = served_xattr(self._node(path).entry, name)
        if val is None:
            raise _err(errno.ENODATA)
        return val

    def listxattr(self, path: str) -> list[str]:
        return served_xattr_names(self._node(path).entry)

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0,
                "f_bavail": 0, "f_files": len(self.nodes), "f_ffree": 0, "f_namemax": 255}

    # No open, release, opendir, releasedir, access or flush: libfuse answers them itself
    # (and still applies kernel_cache on open), the mount is read-only (writes get EROFS
    # from the kernel) and permissions are the kernel's (default_permissions), so each file
    # costs the daemon one lookup and its reads, not five round trips into Python.


class LazyFSNoXattrs(LazyFS):
    """For layers without xattrs or opaque dirs (most): no xattr callbacks, so the kernel
    gets ENOSYS once and stops asking. Overlayfs probes several trusted.overlay.* names on
    every lower lookup; answering each from Python cost more than the reads themselves."""

    getxattr = None  # type: ignore[assignment]
    listxattr = None  # type: ignore[assignment]


def served_xattr(e: Entry, name: str) -> bytes | None:
    """An entry's xattr as a lazy mount serves it, as the eager layer cache holds it:
    overlayfs reads its own names from its lower dirs, so of those only an opaque
    directory's marker is served, never a redirect or metacopy an index carried."""
    if name.startswith(OVERLAY_XATTR_PREFIX):
        return b"y" if name == OPAQUE_XATTR and e.opaque else None
    return e.xattrs.get(name)


def served_xattr_names(e: Entry) -> list[str]:
    names = [n for n in e.xattrs if not n.startswith(OVERLAY_XATTR_PREFIX)]
    if e.opaque:
        names.append(OPAQUE_XATTR)
    return names


def needs_xattrs(indexes: list[LayerIndex]) -> bool:
    return any(e.xattrs or e.opaque for ix in indexes for e in ix.entries)


def _attrs(e: Entry, ino: int, nlink: int) -> dict[str, Any]:
    kind = _KIND[e.type if e.type != "hard" else "reg"]
    mode = kind | (0 if e.type == "whiteout" else e.mode & 0o7777)
    size = e.size if e.type == "reg" else len(os.fsencode(e.target)) if e.type == "sym" else 0
    a: dict[str, Any] = {"st_mode": mode, "st_ino": ino, "st_nlink": nlink,
                         "st_uid": e.uid, "st_gid": e.gid, "st_size": size,
                         "st_mtime": e.mtime, "st_atime": e.mtime, "st_ctime": e.mtime,
                         "st_blocks": (size + 511) // 512, "st_blksize": 1 << 16}
    if e.type in ("chr", "blk") and e.rdev:
        a["st_rdev"] = os.makedev(*e.rdev)
    return a


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))
