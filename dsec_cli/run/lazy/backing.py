"""Backing files of a kernel-served lazy mount: a regular file's bytes assembled once, chunk
by chunk through its layer's `LayerSource` (so verified and fetched in coalesced reads), into
the node's file cache, named by what the file holds so identical files of any layer share one,
with their content hash kept beside them and checked on reuse; then registered with the
kernel (``FUSE_DEV_IOC_BACKING_OPEN``), which reads the file itself from then on."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
from typing import Any

import xxhash

from .cache import ChunkCache
from .fs import Node
from .fuseproto import BACKING_MAP, BACKING_OPEN
from .source import LayerSource

log = logging.getLogger(__name__)

CONTENT_XATTR = "user.dsec.xxh3"  # a backing file's content hash, checked on reuse


def file_key(index: Any, entry: Any) -> bytes:
    """A regular file's name in the node's file cache: a hash of its size and its chunk
    extents by chunk id, so identical files of any layer share one backing file."""
    h = hashlib.sha256(struct.pack("<Q", entry.size))
    for ci, off, ln in entry.chunks:
        h.update(index.chunks[ci].chunk_id + struct.pack("<QQ", off, ln))
    return h.digest()[:16]


def assemble(src: LayerSource, node: Node, files: ChunkCache, key: bytes) -> int:
    """The file's bytes written into a new backing file under ``key``, its content hash
    with it; an open descriptor of it."""
    tmp = files.tmp / f"{key.hex()}.{os.getpid()}.{threading.get_ident()}"
    try:
        h = xxhash.xxh3_128()
        with open(tmp, "wb") as f:
            off, size = 0, node.entry.size
            while off < size:
                data = src.read(node.entry, off, 8 << 20)
                if not data:
                    raise OSError(errno.EIO, "short read")
                f.write(data)
                h.update(data)
                off += len(data)
        os.setxattr(tmp, CONTENT_XATTR, h.digest())
    except Exception as e:
        log.error("lazy mount: reading %s (layer %d, %d bytes at 0) failed: %s",
                  node.entry.path, node.layer, node.entry.size, e)
        tmp.unlink(missing_ok=True)
        raise OSError(errno.EIO, str(e)) from e
    # opened before it moves in: eviction may unlink it at once under a small budget
    bfd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    files.adopt(key, tmp)
    return bfd


def register(fuse_fd: int, bfd: int) -> int:
    """The kernel's backing id for the open file ``bfd`` (closed here: the kernel holds its
    own reference)."""
    try:
        arg = bytearray(BACKING_MAP.pack(bfd, 0, 0))
        bid = fcntl.ioctl(fuse_fd, BACKING_OPEN, arg, True)  # True: returns the id
    finally:
        os.close(bfd)
    return int(bid)


def cached(files: ChunkCache, key: bytes) -> int | None:
    """An open fd of the cached backing file, if it is there and its bytes still hash to
    what was stored with them (a damaged file is removed and assembled again)."""
    p = files.path_of(key)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        want = os.getxattr(fd, CONTENT_XATTR)
        h = xxhash.xxh3_128()
        while chunk := os.read(fd, 4 << 20):
            h.update(chunk)
        if h.digest() == want:
            os.utime(fd)  # its last use, for the cache's eviction order
            return fd
    except OSError:
        pass
    os.close(fd)
    log.warning("lazy mount: backing file %s is damaged; assembling it again", p)
    p.unlink(missing_ok=True)
    return None
