"""The archive entry checks (build/tarball.py) remember which parent chains they found clean,
and still refuse exactly what a walk up every member's ancestors refuses: random member
sequences over a few paths (files, directories, symlinks, hardlinks, whiteouts, opaque
markers, replacements in any order) give the same entries, or the same error, both ways."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.build import tarball
from dsec_cli.core.errors import SpecError

NAMES = ["a", "a/b", "a/b/c", "a/b/c/f", "a/x", "d", "d/e", "./a//b/g", "a/b/.wh.c",
         "a/.wh..wh..opq", "d/.wh.e"]


def _archive(rng: random.Random) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for _ in range(rng.randint(1, 12)):
            ti = tarfile.TarInfo(rng.choice(NAMES))
            kind = rng.choice("ffddsslw")
            if kind == "d":
                ti.type = tarfile.DIRTYPE
            elif kind == "s":
                ti.type, ti.linkname = tarfile.SYMTYPE, rng.choice(["/etc", "b", "x/y"])
            elif kind == "l":
                ti.type, ti.linkname = tarfile.LNKTYPE, rng.choice(NAMES[:5])
            elif kind == "w":
                ti.name = ti.name.rpartition("/")[0] + "/.wh." + ti.name.rpartition("/")[2]
                ti.name = ti.name.lstrip("/")
            data = b"x" if ti.isreg() else b""
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def _scan(data: bytes, base: str) -> Any:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            out = tarball.scan_members(tf, Path("t.tar"), base, lambda tf, m, e: None)
    except SpecError as e:
        return e.message
    return {k: (v.entry.type, v.entry.target, v.entry.opaque) for k, v in out.items()}


@pytest.mark.parametrize("base", ["", "opt/app"])
def test_remembered_parents_refuse_what_a_full_walk_refuses(
        base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(99)
    walk = tarball._check_parents
    refused = 0
    for n in range(1500):
        data = _archive(rng)
        fast = _scan(data, base)
        with monkeypatch.context() as m:
            m.setattr(tarball, "_check_parents",
                      lambda out, path, b, name, src, clean=None: walk(out, path, b, name, src))
            full = _scan(data, base)
        assert fast == full, n
        refused += isinstance(fast, str) and "lies below" in fast
    assert refused > 50  # the sequences do reach the check


def test_write_through_a_symlink_made_after_its_parent_was_checked() -> None:
    """A directory's children are checked, then it is replaced by a symlink: a member below
    it is refused although the path was found clean before."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind in [("etc", tarfile.DIRTYPE), ("etc/a", tarfile.REGTYPE),
                           ("etc", tarfile.SYMTYPE), ("etc/passwd", tarfile.REGTYPE)]:
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname = kind, "/etc" if kind == tarfile.SYMTYPE else ""
            tf.addfile(ti, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    assert "lies below 'etc'" in _scan(buf.getvalue(), "")
