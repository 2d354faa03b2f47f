"""The FUSE wire protocol as the kernel speaks it on ``/dev/fuse``: the structures of
``include/uapi/linux/fuse.h`` (protocol 7.40+, with passthrough), the opcodes and flags a
read-only lazy mount uses, and the mount(2) call that hands the kernel the descriptor.
Nothing here keeps state; `kernelfs.PassthroughServer` answers the requests."""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from .fs import Node

KERNEL_MIN = (6, 9)
IN_HEADER = struct.Struct("<IIQQIIIHH")  # fuse_in_header
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
ENTRY_OUT = struct.Struct("<QQQQII")  # fuse_entry_out, before its fuse_attr
ATTR_OUT = struct.Struct("<QII")  # fuse_attr_out, before its fuse_attr
OPEN_OUT = struct.Struct("<QIi")
READ_IN = struct.Struct("<QQII")
INIT_IN = struct.Struct("<IIIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
DIRENT = struct.Struct("<QQII")
BACKING_MAP = struct.Struct("<iIQ")
BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)

LOOKUP, FORGET, GETATTR, READLINK, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 5, 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 22, 23, 25, 26, 27, 28, 29
INTERRUPT, DESTROY, BATCH_FORGET, READDIRPLUS = 36, 38, 42, 44
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}

F_ASYNC_READ, F_BIG_WRITES, F_DO_READDIRPLUS = 1 << 0, 1 << 5, 1 << 13
F_CACHE_SYMLINKS, F_MAX_PAGES, F_INIT_EXT = 1 << 23, 1 << 22, 1 << 30
F2_PASSTHROUGH = 1 << (37 - 32)
FOPEN_KEEP_CACHE, FOPEN_NOFLUSH, FOPEN_PASSTHROUGH = 1 << 1, 1 << 5, 1 << 7
TIMEOUT = 86400  # a layer never changes: entries and attributes are cached for a day
MAX_READ = 1 << 20
MAX_WRITE = 4096  # nothing is written to a read-only mount: the smallest the kernel takes
REQUEST_BUFFER = 64 << 10  # >= the kernel's minimum (8 KiB) and any lookup or xattr name


def supported() -> str | None:
    """None when this kernel serves lazy reads by passthrough, else why not."""
    try:
        rel = tuple(int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return "kernel version not understood"
    if rel < KERNEL_MIN:
        return f"kernel {os.uname().release} predates FUSE passthrough (6.9)"
    return None


def libc_mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    """mount(2), which the os module lacks: a FUSE mount is given its descriptor in ``data``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                  data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


def attr(node: Node) -> bytes:
    """A node's ``fuse_attr``."""
    a = node.attrs
    sec, ns = divmod(int(a["st_mtime"]), 10**9)  # LazyFS keeps times in ns (use_ns)
    return ATTR.pack(node.ino, a["st_size"], a["st_blocks"], sec, sec, sec, ns, ns, ns,
                     a["st_mode"], a["st_nlink"], a["st_uid"], a["st_gid"],
                     a.get("st_rdev", 0), 4096, 0)


def xattr_reply(val: bytes, size: int) -> bytes:
    """A GETXATTR or LISTXATTR answer: the size alone when asked for it (``size`` 0)."""
    if size == 0:
        return struct.pack("<II", len(val), 0)
    if len(val) > size:
        raise OSError(errno.ERANGE, "buffer too small")
    return val
