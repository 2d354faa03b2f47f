"""Walking two trees and comparing them byte for byte and in metadata."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any


def describe(root: Path, *, mtimes: bool = True, root_meta: bool = True) -> dict[str, Any]:
    """path -> every property a layer must preserve; hardlinks by group."""
    out: dict[str, Any] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [".", *sorted(dirnames), *sorted(filenames)]:
            if name == "." and Path(dirpath) != root:
                continue
            full = os.path.join(dirpath, name) if name != "." else dirpath
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            d: dict[str, Any] = {"mode": stat.filemode(st.st_mode), "uid": st.st_uid,
                                 "gid": st.st_gid}
            if mtimes and not stat.S_ISLNK(st.st_mode):
                d["mtime"] = st.st_mtime_ns
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    d["sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
                if st.st_nlink > 1:
                    d["link_group"] = inodes.setdefault((st.st_dev, st.st_ino), rel)
            elif stat.S_ISLNK(st.st_mode):
                d["target"] = os.readlink(full)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                d["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
            try:
                names = os.listxattr(full, follow_symlinks=False)
            except OSError:
                names = []
            xs = {n: os.getxattr(full, n, follow_symlinks=False) for n in sorted(names)
                  if not n.startswith("security.")}
            if xs:
                d["xattrs"] = xs
            if rel == "." and not root_meta:
                continue
            out[rel] = d
    return out


def assert_same_tree(a: Path, b: Path, **kw: Any) -> None:
    da, db = describe(a, **kw), describe(b, **kw)
    missing = sorted(set(da) - set(db))
    extra = sorted(set(db) - set(da))
    assert not missing and not extra, f"only in {a}: {missing[:10]}; only in {b}: {extra[:10]}"
    diffs = [(p, da[p], db[p]) for p in sorted(da) if da[p] != db[p]]
    assert not diffs, "differences:\n" + "\n".join(f"{p}: {x} != {y}" for p, x, y in diffs[:10])
