"""Source trees with every kind of entry a layer must carry."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from dsec_cli.push.stores import Store, open_store


def make_tree(root: Path, *, owners: bool = True, seed: int = 1) -> Path:
    rnd = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "etc").mkdir()
    (root / "data/deep/er").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "etc/empty").write_bytes(b"")
    (root / "etc/small.conf").write_text("key = value\n" * 3)
    for i in range(40):  # many small files share batch chunks
        (root / f"data/file{i:02d}.txt").write_text(f"line {i}\n" * (i * 7 + 1))
    (root / "data/medium.bin").write_bytes(rnd.randbytes(20_000))
    (root / "data/deep/er/large.bin").write_bytes(rnd.randbytes(700_000) + b"\0" * 300_000)
    (root / "data/text.log").write_text("".join(f"event {i} ok\n" for i in range(60_000)))
    os.symlink("../etc/small.conf", root / "data/rel-link")
    os.symlink("/etc/small.conf", root / "data/abs-link")
    os.symlink("does-not-exist", root / "data/dangling")
    os.link(root / "data/medium.bin", root / "data/hard-a")
    os.link(root / "data/medium.bin", root / "etc/hard-b")
    os.mkfifo(root / "data/fifo")
    (root / "bin").mkdir()
    (root / "bin/tool").write_bytes(b"#!/bin/sh\necho tool\n")
    os.chmod(root / "bin/tool", 0o4755)
    os.chmod(root / "etc/small.conf", 0o600)
    os.chmod(root / "empty-dir", 0o1777)
    os.setxattr(root / "etc/small.conf", "user.dsec.test", b"\x00binary\xff")
    if owners:
        os.mknod(root / "data/null", 0o20666, os.makedev(1, 3))
        os.chown(root / "bin/tool", 1234, 5678, follow_symlinks=False)
        os.chown(root / "data/deep", 42, 43)
        os.chmod(root / "bin/tool", 0o4755)  # chown clears setuid
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(p, ns=(1_600_000_000_123_456_789 + i * 1_000_000_007,) * 2,
                 follow_symlinks=False)
    os.utime(root, ns=(1_650_000_000_000_000_001,) * 2)
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A file store at ``tmp_path / "store"``, opened as every caller opens one."""
    return open_store(str(tmp_path / "store"))


def write_spec(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"{name}.yaml"
    p.write_text(text)
    return p


def store_snapshot(root: Path) -> dict[str, int]:
    """Every object of a file store with its size (temporary files excluded)."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and "tmp" not in p.relative_to(root).parts}
