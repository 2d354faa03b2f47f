"""Lazy layers served by the kernel: a FUSE server speaking the protocol on ``/dev/fuse``
itself, with FUSE passthrough (kernel ≥ 6.9, ``CONFIG_FUSE_PASSTHROUGH``).

Metadata (lookup, getattr, readdir, readlink, xattrs) is answered from the same in-memory
tree as `LazyFS`; listings carry attributes (READDIRPLUS), so a walk sends no lookups. A small
file (up to ``INLINE_FILE``) gets no backing file: its reads are answered from memory. On the
first open of a larger regular file its bytes are assembled — chunk by
chunk through the layer's `LayerSource`, so verified and fetched in coalesced ranged reads —
into a backing file in the node's file cache (``<cache>/files``, shared by every mount and
bounded by the node's cache budget like the chunk cache); the backing file is registered with the
kernel (``FUSE_DEV_IOC_BACKING_OPEN``) and the open is answered with its id, after which
reads and mmaps of that file go to the backing file inside the kernel and never reach this
process. Debian's libfuse (3.14) predates passthrough, hence the protocol spoken directly;
the structures (`fuseproto`) are those of ``include/uapi/linux/fuse.h`` (protocol 7.40+).

The hot requests of a walk — every file's OPEN and RELEASE, a small file's READs, a
directory's OPENDIR, READDIRPLUS and LOOKUPs, GETATTR, FORGET — are answered by a compiled
loop (``_fuseloop.c``, built by setup.py) from per-inode tables this module fills as
it learns the answers: open flags and backing ids, the verified bytes of small files whose
chunks are in memory (handed over chunk by chunk as they arrive), directory listings and
their children's entries (handed over a level ahead of the walk), attributes. The loop reads
``/dev/fuse`` without the GIL and hands every other request back here as bytes. Without the
extension, or with ``DSEC_PY_FUSELOOP`` set, this module answers every request itself.

A killed server closes ``/dev/fuse``: the kernel aborts the connection (readers get
``ENOTCONN``) and drops every backing id; cleanup detaches the mount as for the libfuse
daemon.

The wire structures are `fuseproto`'s, backing files `backing`'s, the read-ahead of small
files and what the compiled loop is handed of their bytes `readahead`'s; this module answers
the requests.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...core.config import env
from . import backing
from .cache import ChunkCache
from .fs import LazyFS, Node, served_xattr, served_xattr_names
from .fuseproto import (
    ATTR,
    ATTR_OUT,
    BATCH_FORGET,
    DESTROY,
    DIRENT,
    ENTRY_OUT,
    F2_PASSTHROUGH,
    F_ASYNC_READ,
    F_BIG_WRITES,
    F_CACHE_SYMLINKS,
    F_DO_READDIRPLUS,
    F_INIT_EXT,
    F_MAX_PAGES,
    FLUSH,
    FOPEN_KEEP_CACHE,
    FOPEN_NOFLUSH,
    FOPEN_PASSTHROUGH,
    FORGET,
    GETATTR,
    GETXATTR,
    IN_HEADER,
    INIT,
    INIT_IN,
    INIT_OUT,
    LISTXATTR,
    LOOKUP,
    MAX_READ,
    MAX_WRITE,
    NO_REPLY,
    OPEN,
    OPEN_OUT,
    OPENDIR,
    OUT_HEADER,
    READ,
    READ_IN,
    READDIR,
    READDIRPLUS,
    READLINK,
    RELEASE,
    RELEASEDIR,
    REQUEST_BUFFER,
    STATFS,
    TIMEOUT,
    libc_mount,
    supported,
    xattr_reply,
)
from .fuseproto import attr as node_attr
from .readahead import INLINE_FILE, ReadAhead

try:  # built by setup.py; without it the Python loop below answers every request
    from . import _fuseloop  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _fuseloop = None

log = logging.getLogger(__name__)

#: small files' bytes the compiled loop holds at most (verified chunks it keeps, or copies of
#: files spanning chunks; past it, further small files are read here from the memory cache)
LOOP_INLINE_BUDGET = 64 << 20
#: threads reading /dev/fuse through the compiled loop (each answers in C without the GIL)
LOOP_READERS = 2

__all__ = ["PassthroughServer", "compiled_loop", "supported"]


def compiled_loop() -> bool:
    """Whether new servers answer their hot requests in the compiled loop."""
    return _fuseloop is not None and not env("DSEC_PY_FUSELOOP")


class PassthroughServer:
    """One mount, served from ``fs``'s tree; files opened through backing files in ``files``."""

    def __init__(self, fs: LazyFS, mountpoint: str, files: ChunkCache, *, xattrs: bool,
                 on_init: Any = None, workers: int = 4, compiled: bool | None = None) -> None:
        self.fs = fs
        self.mountpoint = mountpoint
        self.files = files
        self.xattrs = xattrs
        self.on_init = on_init
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="open")
        self.inodes: dict[int, tuple[str, Node]] = {}
        for path, node in fs.nodes.items():
            self.inodes.setdefault(node.ino, (path, node))
        self.backing: dict[int, int] = {}  # inode -> backing id, registered once per mount
        self.locks: dict[int, threading.Lock] = {}
        self.readahead = ReadAhead(fs, self.inodes)
        self.walks = ThreadPoolExecutor(1, thread_name_prefix="walk")  # `_walked`, in order
        self.lock = threading.Lock()
        self.fd = -1
        self.passthrough = False
        self.compiled = compiled_loop() if compiled is None else compiled
        self.loop: Any = None  # the compiled loop's tables, once mounted
        self._handed: set[int] = set()  # directories whose listing the loop answers

    # -- lifecycle ----------------------------------------------------------------------------
    def sweep(self) -> None:
        """Remove partial backing files of servers that died while assembling them (named
        ``<key>.<pid>.<thread>``; a live server's are kept)."""
        self.files.sweep()

    def mount(self) -> None:
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        libc_mount("dsec-lazy", self.mountpoint, "fuse.dsec",
                    os.ST_RDONLY | os.ST_NOSUID | os.ST_NODEV,
                    f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other,"
                    "default_permissions")
        if self.compiled:
            self.loop = _fuseloop.Loop(self.fd, max(self.inodes) + 1, LOOP_INLINE_BUDGET)
            self.readahead.loop = self.loop
            rec = self.fs.recorder
            if rec is not None:
                self.loop.record_until(rec.started + rec.window)
                rec.pull = self._collect_opens
            for src in self.fs.sources:
                src.fetcher.stats.pull = self._loop_counts

    def serve(self) -> None:
        """Answer requests until the mount goes (ENODEV) or DESTROY."""
        if self.loop is None:
            return self._serve_python()
        for n in range(LOOP_READERS - 1):
            threading.Thread(target=self._serve_compiled, name=f"fuse{n}", daemon=True).start()
        self._serve_compiled()

    def _serve_compiled(self) -> None:
        """One reader of the compiled loop: it answers what its tables know and returns the
        rest (a copy of the request), answered here as by the Python loop."""
        while True:
            got = self.loop.next()
            if got is None:
                return  # unmounted
            if isinstance(got, int):  # a marked file or directory was read: followed up by
                self.walks.submit(self._walked, got)  # another thread, this one reads on
                continue
            ln, op, unique, nodeid, _, _, _, _, _ = IN_HEADER.unpack_from(got)
            if self._dispatch(op, unique, nodeid, memoryview(got)[IN_HEADER.size:ln]):
                return

    def counters(self) -> dict[str, Any]:
        """What the compiled loop did: requests answered there and handed here, bytes it
        served, inline bytes it holds (empty without the loop)."""
        return self.loop.counters() if self.loop is not None else {}

    def _loop_counts(self) -> dict[str, int]:
        return {"bytes_served": self.loop.counters()["bytes_served"]}

    def _collect_opens(self) -> None:
        """First opens the compiled loop answered, into the access profile."""
        rec = self.fs.recorder
        assert rec is not None  # pulled by the recorder itself
        for ino, at in self.loop.opens():
            node = self.inodes[ino][1]
            rec.touch(node.layer, node.entry.path, at=at)

    def _serve_python(self) -> None:
        # requests of a read-only mount are small (no WRITE; max_write is the minimum), so
        # one buffer is reused and each request's body copied out
        buf = bytearray(REQUEST_BUFFER)
        view = memoryview(buf)
        while True:
            try:
                n = os.readv(self.fd, [buf])
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                    continue  # an interrupted request; the kernel has forgotten it
                if e.errno == errno.ENODEV:
                    return  # unmounted
                raise
            ln, op, unique, nodeid, _, _, _, _, _ = IN_HEADER.unpack_from(buf)
            body = view[IN_HEADER.size:min(ln, n)]  # valid until the next read: copied for the pool
            if self._dispatch(op, unique, nodeid, body):
                return

    def _dispatch(self, op: int, unique: int, nodeid: int, body: memoryview) -> bool:
        """Answer one request (True after DESTROY). Opens that may fetch or assemble, and
        reads of bytes not in memory, go to the pool; the rest (metadata, re-opens, small
        files' opens) is answered at once."""
        if op == READ:
            if not self._read_inline(unique, nodeid, body):
                self.pool.submit(self._handle, op, unique, nodeid, memoryview(bytes(body)))
            return False
        if op == OPEN and self._needs_backing(nodeid):
            self.pool.submit(self._handle, op, unique, nodeid, memoryview(bytes(body)))
            return False
        self._handle(op, unique, nodeid, body)
        return op == DESTROY

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.readahead.close()
        self.walks.shutdown(wait=False, cancel_futures=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- replies ------------------------------------------------------------------------------
    def _reply(self, unique: int, data: bytes = b"", err: int = 0) -> None:
        # one writev per reply: the kernel takes each whole, so threads need no lock
        try:
            os.writev(self.fd, [OUT_HEADER.pack(OUT_HEADER.size + len(data), -err, unique), data])
        except OSError as e:  # ENOENT: the request was interrupted meanwhile
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def _handle(self, op: int, unique: int, nodeid: int, body: memoryview) -> None:
        try:
            h = self._ops.get(op)
            if h is None:
                if op not in NO_REPLY:
                    self._reply(unique, err=errno.ENOSYS)
                return
            out = h(self, nodeid, body)
            if op not in NO_REPLY:
                self._reply(unique, out)
        except OSError as e:
            self._reply(unique, err=e.errno or errno.EIO)
        except Exception:
            log.exception("lazy mount: request %d failed", op)
            self._reply(unique, err=errno.EIO)

    def _node(self, nodeid: int) -> tuple[str, Node]:
        got = self.inodes.get(nodeid)
        if got is None:
            raise OSError(errno.ENOENT, "no such inode")
        return got

    def _entry(self, node: Node | None) -> bytes:
        if node is None:  # negative entry, cached as long as a positive one
            return ENTRY_OUT.pack(0, 0, TIMEOUT, TIMEOUT, 0, 0) + bytes(ATTR.size)
        attr = node_attr(node)
        if self.loop is not None:  # its GETATTRs are answered in the compiled loop
            self.loop.set_attr(node.ino, ATTR_OUT.pack(TIMEOUT, 0, 0) + attr)
        return ENTRY_OUT.pack(node.ino, 0, TIMEOUT, TIMEOUT, 0, 0) + attr

    # -- operations ---------------------------------------------------------------------------
    def _init(self, nodeid: int, body: memoryview) -> bytes:
        major, minor, readahead, flags, flags2 = INIT_IN.unpack_from(
            bytes(body).ljust(INIT_IN.size, b"\0"))
        if major != 7:
            raise OSError(errno.EPROTO, f"FUSE protocol {major}")
        full = flags & F_INIT_EXT and minor >= 40 and flags2 & F2_PASSTHROUGH
        self.passthrough = bool(full)
        # listings carry each entry's attributes (READDIRPLUS), so a walk that opens what it
        # listed sends no LOOKUPs; link targets stay in the page cache
        out_flags = (F_ASYNC_READ | F_BIG_WRITES | F_MAX_PAGES | F_DO_READDIRPLUS
                     | F_CACHE_SYMLINKS | (F_INIT_EXT if full else 0)) & (flags | F_INIT_EXT)
        out = INIT_OUT.pack(7, min(minor, 40), readahead, out_flags, 16, 12, MAX_WRITE, 1,
                             MAX_READ // 4096, 0, F2_PASSTHROUGH if full else 0, 1)
        if not full:
            log.warning("lazy mount: the kernel did not offer FUSE passthrough")
        if self.loop is not None:
            self._register_small_opens()
        if self.on_init is not None:
            threading.Timer(0, self.on_init).start()  # after the reply is written
        return out

    def _lookup(self, nodeid: int, body: memoryview) -> bytes:
        path, node = self._node(nodeid)
        name = bytes(body).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        base = "" if path == "/" else path
        return self._entry(self.fs.nodes.get(f"{base}/{name}"))

    def _getattr(self, nodeid: int, body: memoryview) -> bytes:
        out = ATTR_OUT.pack(TIMEOUT, 0, 0) + node_attr(self._node(nodeid)[1])
        if self.loop is not None:
            self.loop.set_attr(nodeid, out)
        return out

    def _readlink(self, nodeid: int, body: memoryview) -> bytes:
        node = self._node(nodeid)[1]
        if node.entry.type != "sym":
            raise OSError(errno.EINVAL, "not a link")
        return os.fsencode(node.entry.target)

    def _register_small_opens(self) -> None:
        """Opens answered without a backing file (small files; every file without
        passthrough) are the same for every such file: all answered in the compiled loop.
        Empty files' reads too (nothing to read), and links' targets."""
        for ino, (_, node) in self.inodes.items():
            e = node.entry
            if node.children is not None:  # OPENDIR: the same answer for every directory
                self.loop.set_open(ino, FOPEN_KEEP_CACHE, 0)
            elif e.type == "reg" and (not self.passthrough or e.size <= INLINE_FILE):
                self.loop.set_open(ino, FOPEN_KEEP_CACHE | FOPEN_NOFLUSH, 0)
                if e.size == 0:
                    self.loop.set_data(ino, b"", False)
            elif e.type == "sym":  # READLINK: a link's data in the loop is its target
                self.loop.set_data(ino, os.fsencode(e.target), False)

    def _needs_backing(self, nodeid: int) -> bool:
        """Whether an open of ``nodeid`` is answered with a backing file not registered yet
        (false for small files, whose reads this process answers)."""
        got = self.inodes.get(nodeid)
        return (got is not None and self.passthrough and got[1].entry.size > INLINE_FILE
                and nodeid not in self.backing)

    def _open(self, nodeid: int, body: memoryview) -> bytes:
        path, node = self._node(nodeid)
        if self.fs.recorder is not None:
            self.fs.recorder.touch(node.layer, node.entry.path)
        if not self.passthrough or node.entry.size <= INLINE_FILE:
            # no FLUSH on close either: nothing is ever written
            return OPEN_OUT.pack(0, FOPEN_KEEP_CACHE | FOPEN_NOFLUSH, 0)
        with self.lock:
            lock = self.locks.setdefault(node.ino, threading.Lock())
        with lock:  # two openers of one file assemble it once
            bid = self.backing.get(node.ino)
            if bid is None:
                bid = self.backing[node.ino] = self._register(node, path)
                if self.loop is not None:  # its next opens are answered in the loop
                    self.loop.set_open(node.ino, FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, bid)
        return OPEN_OUT.pack(0, FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, bid)

    def _register(self, node: Node, path: str) -> int:
        """The file's backing file in the node's file cache (assembled if missing or not
        matching the content hash it was stored with), registered with the kernel."""
        src = self.fs.sources[node.layer]
        key = backing.file_key(src.index, node.entry)
        bfd = backing.cached(self.files, key)
        if bfd is None:
            self.readahead.fetch_with_neighbours(node)
            bfd = backing.assemble(src, node, self.files, key)
        return backing.register(self.fd, bfd)

    def _walked(self, ino: int) -> None:
        """The loop answered a listing handed over ahead (its subdirectories' listings are
        handed over next), or a read of a small file in its layer's read-ahead window."""
        path, node = self.inodes[ino]
        if node.children is not None:
            for sub in node.children:
                self._hand_over_dir(f"{'' if path == '/' else path}/{sub}")
            return
        try:
            self.readahead.sequential(node)
        except Exception as e:  # read-ahead only: readers fetch what is missing themselves
            log.warning("lazy mount: reading ahead after inode %d failed: %s", ino, e)

    def _read(self, nodeid: int, body: memoryview) -> bytes:
        _, offset, size, _ = READ_IN.unpack_from(body)
        path, node = self._node(nodeid)
        try:
            self.readahead.fetch_with_neighbours(node)
            self.readahead.sequential(node)
        except Exception as e:  # as LazyFS.read: logged, and the reader gets EIO
            log.error("lazy mount: reading %s (layer %d, %d bytes at %d) failed: %s",
                      node.entry.path, node.layer, size, offset, e)
            raise OSError(errno.EIO, str(e)) from e
        return self.fs.read(path, size, offset, 0)

    def _read_inline(self, unique: int, nodeid: int, body: memoryview) -> bool:
        """Answer a READ here when all its file's chunks are in memory; False otherwise
        (then the pool answers it: it may wait for the disk or the store)."""
        got = self.inodes.get(nodeid)
        if got is None or got[1].entry.type not in ("reg", "hard"):
            return False
        node = got[1]
        src = self.fs.sources[node.layer]
        if not all(src.fetcher.in_memory(src.index.chunks[ci].chunk_id)
                   for ci, _, _ in node.entry.chunks):
            return False
        self._handle(READ, unique, nodeid, body)
        return True

    def _opendir(self, nodeid: int, body: memoryview) -> bytes:
        return OPEN_OUT.pack(0, FOPEN_KEEP_CACHE, 0)

    def _readdir(self, nodeid: int, body: memoryview, plus: bool = False) -> bytes:
        _, offset, size, _ = READ_IN.unpack_from(body)
        path, node = self._node(nodeid)
        if node.children is None:
            raise OSError(errno.ENOTDIR, "not a directory")
        if plus and self.loop is not None:
            recs = self._hand_over(path, node, False)
            for sub in node.children:  # the walk's next listings, ahead of it
                self._hand_over_dir(f"{'' if path == '/' else path}/{sub}")
            out = bytearray()
            for rec in recs[offset:]:
                if len(out) + len(rec) > size:
                    break
                out += rec
            return bytes(out)
        base = "" if path == "/" else path
        names = [(".", node), ("..", node)] + [(n, self.fs.nodes[f"{base}/{n}"])
                                               for n in node.children]
        out = bytearray()
        for i in range(offset, len(names)):
            name, child = names[i]
            raw = os.fsencode(name)
            rec = DIRENT.pack(child.ino, i + 1, len(raw),
                               stat.S_IFMT(child.attrs["st_mode"]) >> 12) + raw
            if plus:  # "." and "..": no entry (node id 0), the kernel keeps its own
                rec = self._entry(child if i >= 2 else None) + rec
            rec += bytes(-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return bytes(out)

    def _hand_over_dir(self, path: str) -> None:
        node = self.fs.nodes[path]
        if node.children is not None and node.ino not in self._handed:
            self._hand_over(path, node, True)

    def _hand_over(self, path: str, node: Node, notify: bool) -> list[bytes]:
        """A directory's whole listing (READDIRPLUS records) and its children's lookups,
        handed to the compiled loop, which answers them from now on. With ``notify``, the
        loop reports the first listing it answers (`_walked`: the walk went in, so its
        subdirectories are handed over next)."""
        base = "" if path == "/" else path
        names = [(".", node), ("..", node)] + [(n, self.fs.nodes[f"{base}/{n}"])
                                               for n in node.children or ()]
        recs, starts, pos, lookups = [], [], 0, []
        for i, (name, child) in enumerate(names):
            raw = os.fsencode(name)
            entry = self._entry(child if i >= 2 else None)
            rec = entry + DIRENT.pack(child.ino, i + 1, len(raw),
                                       stat.S_IFMT(child.attrs["st_mode"]) >> 12) + raw
            rec += bytes(-len(rec) % 8)
            recs.append(rec)
            starts.append(pos)
            pos += len(rec)
            if i >= 2:
                lookups.append((raw, entry))
        self._handed.add(node.ino)
        self.loop.set_names(node.ino, lookups)
        self.loop.set_listing(node.ino, b"".join(recs), starts)
        if notify:
            self.loop.set_notify(node.ino, True)
        return recs

    def _readdirplus(self, nodeid: int, body: memoryview) -> bytes:
        return self._readdir(nodeid, body, plus=True)

    def _getxattr(self, nodeid: int, body: memoryview) -> bytes:
        if not self.xattrs:
            raise OSError(errno.ENOSYS, "no xattrs")  # the kernel stops asking
        size = struct.unpack_from("<I", body)[0]
        name = bytes(body[8:]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        e = self._node(nodeid)[1].entry
        val = served_xattr(e, name)
        if val is None:
            raise OSError(errno.ENODATA, "no such attribute")
        return xattr_reply(val, size)

    def _listxattr(self, nodeid: int, body: memoryview) -> bytes:
        if not self.xattrs:
            raise OSError(errno.ENOSYS, "no xattrs")
        size = struct.unpack_from("<I", body)[0]
        e = self._node(nodeid)[1].entry
        names = served_xattr_names(e)
        return xattr_reply(b"".join(os.fsencode(n) + b"\0" for n in names), size)

    def _statfs(self, nodeid: int, body: memoryview) -> bytes:
        return struct.pack("<QQQQQIIII24x", 0, 0, 0, len(self.fs.nodes), 0, 4096, 255, 4096, 0)

    def _empty(self, nodeid: int, body: memoryview) -> bytes:
        return b""

    _ops = {INIT: _init, LOOKUP: _lookup, GETATTR: _getattr, READLINK: _readlink,
            OPEN: _open, READ: _read, OPENDIR: _opendir, READDIR: _readdir,
            READDIRPLUS: _readdirplus,
            GETXATTR: _getxattr, LISTXATTR: _listxattr, STATFS: _statfs,
            RELEASE: _empty, RELEASEDIR: _empty, FLUSH: _empty, DESTROY: _empty,
            FORGET: _empty, BATCH_FORGET: _empty}


