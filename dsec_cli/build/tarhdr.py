"""Tar header blocks read by a compiled decoder (`_tarhdr.c`) where it is built, with
tarfile's own parser for every block it does not answer for.

`TarInfo` plugs into `tarfile.open(..., tarinfo=TarInfo)`: tarfile still does everything
after the header block (pax and GNU long-name records, sparse maps, offsets), so a member
reads exactly as with tarfile alone, only without tarfile's per-field slicing and parsing
in Python, which is most of its cost per member. Without the compiled module (or with
``use_compiled`` off) `TarInfo` is tarfile's own class.

`StreamTarFile` goes one step further for a stream that can show its next bytes without
taking them (`BlockStream`): a plain member (one header block, no pax or GNU records before
it, no global pax header in force) is read in one step, its header looked at in place;
every other block, the end of the archive and every error are left to tarfile's own
`next`, which then reads the same block from the same place.
"""

from __future__ import annotations

import tarfile
from typing import Any, Protocol

try:
    from . import _tarhdr  # type: ignore[attr-defined]
except ImportError:  # not built (setup.py builds it): tarfile's parser reads all
    _tarhdr = None

#: read headers with the compiled decoder (tests turn it off to compare both)
use_compiled = _tarhdr is not None


class _CompiledInfo(tarfile.TarInfo):
    """A member whose header block was decoded in one compiled call; the same attributes,
    set in the same order, as `tarfile.TarInfo.frombuf` sets them."""

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> _CompiledInfo:
        got = _tarhdr.header(buf, encoding, errors)
        if got is None:  # a form the decoder leaves to tarfile (errors raised there)
            return super().frombuf(buf, encoding, errors)
        return cls.from_fields(got)

    @classmethod
    def from_fields(cls, got: tuple) -> _CompiledInfo:  # type: ignore[type-arg]
        """A member from the decoder's fields, as tarfile's ``frombuf`` makes it."""
        obj = cls()
        (obj.name, obj.mode, obj.uid, obj.gid, obj.size, obj.mtime, obj.chksum, obj.type,
         obj.linkname, obj.uname, obj.gname, obj.devmajor, obj.devminor, prefix) = got
        # what tarfile does after the fields (the old GNU sparse header never gets here)
        if obj.type == tarfile.AREGTYPE and obj.name.endswith("/"):
            obj.type = tarfile.DIRTYPE
        if obj.isdir():
            obj.name = obj.name.rstrip("/")
        if prefix and obj.type not in tarfile.GNU_TYPES:
            obj.name = prefix + "/" + obj.name
        return obj


def tarinfo_class() -> type[tarfile.TarInfo]:
    """The member class to open archives with (`tarfile.open(tarinfo=...)`)."""
    return _CompiledInfo if use_compiled and _tarhdr is not None else tarfile.TarInfo


class BlockStream(Protocol):
    """What `StreamTarFile` reads from: a file that goes forward, and can show the next
    bytes of its current piece without taking them."""

    def read(self, n: int = -1) -> bytes: ...

    def tell(self) -> int: ...

    def seek(self, offset: int, whence: int = 0) -> int: ...

    def block(self, n: int) -> memoryview | None:
        """The next ``n`` bytes, not taken, or None where one piece does not hold them."""

    def skip(self, n: int) -> None:
        """Take the ``n`` bytes `block` showed."""


#: the member types read in one step: each one header block and, for a regular file, its
#: data (tarfile's ``_proc_builtin``). Pax and GNU records, sparse files, contiguous and
#: unknown types go through tarfile
_PLAIN_TYPES = frozenset((tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE,
                          tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
                          tarfile.BLKTYPE, tarfile.FIFOTYPE))
_DATA_TYPES = frozenset((tarfile.REGTYPE, tarfile.AREGTYPE))
_BLOCK = tarfile.BLOCKSIZE


class StreamTarFile(tarfile.TarFile):
    """A `tarfile.TarFile` over a `BlockStream` whose plain members are read in one step
    (see the module's text); open it with ``StreamTarFile.open(fileobj=..., mode="r:")``.
    What ``next`` returns, and the offsets it leaves, are tarfile's own."""

    fileobj: BlockStream  # type: ignore[assignment]

    def next(self) -> tarfile.TarInfo | None:
        t: Any = self  # tarfile's own attributes, which its stubs do not list
        if (t.firstmember is not None or self.pax_headers or not use_compiled
                or _tarhdr is None):
            return super().next()
        t._check("ra")
        f = self.fileobj
        if self.offset != f.tell():  # past the data of the member before
            if f.seek(self.offset) != self.offset:
                raise tarfile.ReadError("unexpected end of data")
        blk = f.block(_BLOCK)
        got = _tarhdr.header(blk, self.encoding, self.errors) if blk is not None else None
        if got is None or got[7] not in _PLAIN_TYPES:
            return super().next()  # tarfile reads this block itself, from here
        obj = _CompiledInfo.from_fields(got)
        f.skip(_BLOCK)
        obj.offset = self.offset
        obj.offset_data = offset = self.offset + _BLOCK
        if obj.type in _DATA_TYPES:
            offset += -(-obj.size // _BLOCK) * _BLOCK
        self.offset = offset
        t.members.append(obj)
        return obj
