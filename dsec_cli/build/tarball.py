"""Reading tar archives (tar, tar.gz, tar.xz, tar.zst) into layer entries, safely.

Absolute paths, ``..`` components, hardlinks to outside the archive, relative symlinks
that climb out of the root, and members below a path the archive made a symlink (or any
other non-directory) are rejected, so no later member can land outside the root whatever
the archive's links. A later member for the same path replaces the earlier one (a
directory replaced by a non-directory loses its children). OCI-style whiteouts
(``.wh.NAME``, ``.wh..wh..opq``) become whiteout entries and opaque directories. Regular
files' bytes are spooled to a staging directory so the archive is read once, as a stream;
a sparse member is spooled sparse, from its data map, so what is spooled is what the archive
holds, and its apparent size is bounded by `MAX_SPARSE_SIZE`.
"""

from __future__ import annotations

import logging
import posixpath
import shutil
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ..core.errors import SpecError
from ..format.index import Entry
from ..format.tree import Scanned
from ..format.validate import layer_xattrs

#: the largest apparent size of a sparse member (its data is bounded by the archive itself)
MAX_SPARSE_SIZE = 64 << 30
WH_PREFIX = ".wh."
WH_OPAQUE = ".wh..wh..opq"
log = logging.getLogger(__name__)


@contextmanager
def open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    if path.name.endswith(".zst"):
        import zstandard

        with open(path, "rb") as raw:
            reader: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(raw)  # type: ignore[assignment]
            with tarfile.open(fileobj=reader, mode="r|") as tf:
                yield tf
    else:
        with tarfile.open(path, mode="r|*") as tf:
            yield tf


def _norm(name: str, what: str, src: Path) -> str:
    if name.startswith("/"):
        raise SpecError(f"archive entry {name!r} is an absolute path", path=str(src))
    parts = name.split("/")
    if "" not in parts and "." not in parts and ".." not in parts:
        return name  # already normal (most names): no list rebuilt
    parts = [p for p in parts if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise SpecError(f"archive {what} {name!r} escapes the root", path=str(src))
    return "/".join(parts) or "."


def _mtime_ns(m: tarfile.TarInfo) -> int:
    """Exact nanoseconds: pax headers carry a decimal string that a float would round."""
    text = m.pax_headers.get("mtime")
    if text:
        whole, _, frac = text.partition(".")
        return int(whole) * 1_000_000_000 + int((frac + "000000000")[:9] or 0) * (
            -1 if whole.startswith("-") else 1)
    return int(m.mtime) * 1_000_000_000


def _symlink_escapes(path: str, target: str) -> bool:
    if target.startswith("/"):
        return False  # absolute targets resolve inside the sandbox's own root
    depth = len(path.split("/")) - 1
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def _parent(p: str) -> str:
    """`posixpath.dirname` (or "."), without its general case where it is not needed."""
    i = p.rfind("/")
    if i > 0 and p[i - 1] != "/":
        return p[:i]
    return posixpath.dirname(p) or "."


def _check_parents(out: dict[str, Scanned], path: str, base: str, name: str,
                   src: Path, clean: set[str] | None = None) -> None:
    """Every ancestor the archive itself made must be a directory: a member is never placed
    through the archive's own symlink (or file, or device). ``clean`` holds the paths whose
    own ancestors were found so already (with themselves absent or directories): the walk
    up stops there. The caller empties it when it places a non-directory at one of them."""
    stop = base or "."
    p = path
    seen = []
    while p != "." and p != stop:
        p = _parent(p)
        if clean is not None and p in clean:
            break
        prev = out.get(p)
        if prev is not None and prev.entry.type != "dir":
            raise SpecError(f"archive entry {name!r} lies below {p!r}, which the archive made "
                            f"a {prev.entry.type} entry, not a directory", path=str(src))
        seen.append(p)
    if clean is not None:
        clean.update(seen)


def _replace(out: dict[str, Scanned], path: str, kind: str) -> None:
    """A later member replaces an earlier one; a directory replaced by a non-directory loses
    what was below it."""
    prev = out.get(path)
    if prev is not None and prev.entry.type == "dir" and kind != "dir":
        prefix = path + "/"
        for k in [k for k in out if k.startswith(prefix)]:
            del out[k]


def _spool(tf: tarfile.TarFile, m: tarfile.TarInfo, dest: str, src: Path) -> None:
    fobj = tf.extractfile(m)
    sparse = getattr(m, "sparse", None)
    with open(dest, "wb") as f:
        if fobj is None:
            return
        if not sparse:
            shutil.copyfileobj(fobj, f, 1 << 20)
            return
        # the data map, checked, then only its pieces are copied: holes stay holes
        if m.size > MAX_SPARSE_SIZE:
            raise SpecError(f"archive member {m.name!r} is sparse with an apparent size of "
                            f"{m.size} bytes, over the limit of {MAX_SPARSE_SIZE}",
                            path=str(src))
        # the unbuffered member reader: it seeks within the member by position alone, and
        # reads a hole as zeros without touching the (stream-read) archive
        raw = fobj.raw  # type: ignore[attr-defined]
        end = 0
        for offset, size in sparse:
            if size == 0:
                continue  # GNU tar pads the map with empty pieces
            if offset < end or size < 0 or offset + size > m.size:
                raise SpecError(f"archive member {m.name!r} has an invalid sparse map",
                                path=str(src))
            end = offset + size
            raw.seek(offset)
            f.seek(offset)
            left = size
            while left:
                piece = raw.read(min(left, 1 << 20))
                if not piece:
                    raise SpecError(f"archive member {m.name!r} is truncated", path=str(src))
                f.write(piece)
                left -= len(piece)
        f.truncate(m.size)


#: what a caller does with a regular member's bytes: returns the host path now holding them
#: (or None when it keeps them some other way, for example already chunked)
OnFile = Callable[[tarfile.TarFile, tarfile.TarInfo, Entry], "str | None"]


def scan_members(tf: tarfile.TarFile, src: Path, base: str, on_file: OnFile, *,
                 devices: bool = True) -> dict[str, Scanned]:
    """The entries of an open archive, by layer path, placed under ``base``; each regular
    member's bytes go to ``on_file`` as the stream reaches them. Without ``devices``,
    device nodes are dropped (logged), except the 0:0 character device overlayfs uses as a
    whiteout, which becomes one."""
    out: dict[str, Scanned] = {}
    clean: set[str] = set()  # see _check_parents

    def put(path: str, scanned: Scanned) -> None:
        if scanned.entry.type != "dir" and path in clean:
            clean.clear()  # a path below which members were checked is no directory now
        out[path] = scanned

    def place(rel: str) -> str:
        if rel == ".":
            return base or "."
        return f"{base}/{rel}" if base else rel

    for m in tf:
        rel = _norm(m.name, "entry", src)
        name = posixpath.basename(rel)
        mtime = _mtime_ns(m)
        xattrs = {k[len("SCHILY.xattr."):]: v.encode("utf-8", "surrogateescape")
                  for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
        if xattrs:
            xattrs = layer_xattrs(xattrs, f"{src}: member {m.name!r}")
        if name == WH_OPAQUE:
            parent = place(posixpath.dirname(rel) or ".")
            _check_parents(out, f"{parent}/{WH_OPAQUE}", base, m.name, src, clean)
            if parent in out:
                out[parent].entry.opaque = True
            else:
                put(parent, Scanned(Entry(parent, "dir", 0o755, opaque=True, mtime=mtime),
                                    None))
            continue
        if name.startswith(WH_PREFIX) or (not devices and m.ischr()
                                          and (m.devmajor, m.devminor) == (0, 0)):
            if name.startswith(WH_PREFIX):
                name = name[len(WH_PREFIX):]
            path = place(posixpath.join(posixpath.dirname(rel), name))
            _check_parents(out, path, base, m.name, src, clean)
            _replace(out, path, "whiteout")
            put(path, Scanned(Entry(path, "whiteout"), None))
            continue
        path = place(rel)
        _check_parents(out, path, base, m.name, src, clean)
        e = Entry(path, "reg", m.mode & 0o7777, m.uid, m.gid, mtime, xattrs=xattrs)
        source = None
        if m.isreg():
            e.size = m.size
            source = on_file(tf, m, e)
        elif m.isdir():
            e.type = "dir"
        elif m.issym():
            if _symlink_escapes(rel, m.linkname):
                raise SpecError(f"archive symlink {m.name!r} -> {m.linkname!r} points "
                                "outside the root", path=str(src))
            e.type, e.target, e.xattrs = "sym", m.linkname, {}
        elif m.islnk():
            target = place(_norm(m.linkname, "hardlink target", src))
            if target == path or target not in out or out[target].entry.type != "reg":
                raise SpecError(f"archive hardlink {m.name!r} -> {m.linkname!r} has no "
                                "regular file target in the archive", path=str(src))
            e.type, e.target = "hard", target
        elif m.ischr() or m.isblk():
            if not devices:
                log.warning("%s: device node %r dropped", src, m.name)
                continue
            e.type, e.rdev = ("chr" if m.ischr() else "blk"), (m.devmajor, m.devminor)
        elif m.isfifo():
            e.type = "fifo"
        else:
            continue
        _replace(out, path, e.type)
        put(path, Scanned(e, source))
    return out


def read_tar(src: Path, dst: str, spool: Path) -> list[Scanned]:
    """Entries of an archive placed under ``dst`` (an absolute layer path)."""
    spool.mkdir(parents=True, exist_ok=True)
    n = 0

    def to_spool(tf: tarfile.TarFile, m: tarfile.TarInfo, e: Entry) -> str:
        nonlocal n
        source = str(spool / f"{n:08d}")
        n += 1
        _spool(tf, m, source, src)
        return source

    try:
        with open_tar(src) as tf:
            out = scan_members(tf, src, dst.strip("/"), to_spool)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise SpecError(f"cannot read archive: {err}", path=str(src)) from err
    return list(out.values())
