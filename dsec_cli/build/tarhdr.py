"""Tar header blocks read by a compiled decoder (`_tarhdr.c`) where it is built, with
tarfile's own parser for every block it does not answer for.

`TarInfo` plugs into `tarfile.open(..., tarinfo=TarInfo)`: tarfile still does everything
after the header block (pax and GNU long-name records, sparse maps, offsets), so a member
reads exactly as with tarfile alone, only without tarfile's per-field slicing and parsing
in Python, which is most of its cost per member. Without the compiled module (or with
``use_compiled`` off) `TarInfo` is tarfile's own class.
"""

from __future__ import annotations

import tarfile

try:
    from . import _tarhdr  # type: ignore[attr-defined]
except ImportError:  # not built (scripts/setup.sh builds it): tarfile's parser reads all
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
