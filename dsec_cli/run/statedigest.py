"""The digest of a sandbox's writable state: what its steps changed relative to its image.

A job's sandbox writes into its overlay's upper dir; a sandbox rebuilt by replay starts from
the image plus snapshot layers (in the node's layer cache, overlayfs form) and writes into a
new upper dir. Both are digested as the same thing: the job's layers merged bottom to top
with the upper dir, as overlayfs would show them, keeping only what differs from the base
image. Timestamps and inode numbers are left out (a replayed step writes the same bytes at
another time); paths, types, modes, owners, contents, link targets and the deletions of base
files are in. The digest is xxh3-128: it detects divergence, it is not a security boundary
(a sandbox can only mislead its own replay).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import xxhash

OPAQUE = "trusted.overlay.opaque"
Entry = tuple[object, ...]


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _drop_below(entries: dict[str, Entry], path: str) -> None:
    prefix = path + "/"
    for k in [k for k in entries if k.startswith(prefix)]:
        del entries[k]


def _file_digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _walk(root: Path, entries: dict[str, Entry]) -> None:
    """Overlay one layer dir (or an upper dir) onto ``entries``."""
    stack = [""]
    while stack:
        rel = stack.pop()
        base = os.path.join(root, rel) if rel else str(root)
        try:
            names = sorted(os.listdir(base))
        except FileNotFoundError:
            continue
        for name in names:
            p = f"{rel}/{name}" if rel else name
            full = os.path.join(base, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue  # removed while read: a sandbox still writing
            owner = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if _is_whiteout(st):
                _drop_below(entries, p)
                entries[p] = ("w",)
            elif stat.S_ISDIR(st.st_mode):
                try:
                    opaque = os.getxattr(full, OPAQUE, follow_symlinks=False) == b"y"
                except OSError:
                    opaque = False
                if opaque or entries.get(p, ("d",))[0] != "d":
                    _drop_below(entries, p)
                entries[p] = ("d", *owner)
                stack.append(p)
            elif stat.S_ISREG(st.st_mode):
                _drop_below(entries, p)
                try:
                    entries[p] = ("f", *owner, _file_digest(full))
                except OSError:
                    continue
            elif stat.S_ISLNK(st.st_mode):
                _drop_below(entries, p)
                entries[p] = ("l", os.readlink(full))
            else:
                _drop_below(entries, p)
                entries[p] = ("o", *owner, stat.S_IFMT(st.st_mode), st.st_rdev)


def state_digest(layers: Sequence[Path], upper: Path, base: Sequence[Path]) -> str:
    """The digest of ``layers`` (bottom to top) and ``upper`` merged, relative to ``base``
    (the image's own lower dirs): a deletion counts only where it hides a base file."""
    entries: dict[str, Entry] = {}
    for d in [*layers, upper]:
        _walk(d, entries)
    h = xxhash.xxh3_128()
    for path in sorted(entries):
        e = entries[path]
        if e[0] == "w" and not any(os.path.lexists(os.path.join(b, path)) for b in base):
            continue  # a file made and deleted again by the job's own steps
        h.update(repr((path, e)).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()
