"""A Debian 12 minbase root filesystem as a tar, for tests and benchmarks that need a real
distribution (apt-get, adduser, perl): made by debootstrap from the Debian mirror on first
use, and kept in /var/tmp (``$DSEC_TEST_DEBIAN_TAR``) for every later run on the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

DEBIAN_TAR = Path(os.environ.get("DSEC_TEST_DEBIAN_TAR",
                                 "/var/tmp/dsec-tests/bookworm-minbase.tar"))


def have_debian() -> bool:
    """Whether `debian_tar` can give a tar: one is kept, or debootstrap can make it."""
    return DEBIAN_TAR.is_file() or shutil.which("debootstrap") is not None


def debian_tar() -> Path:
    """The kept minbase tar, made first (about a minute) when there is none."""
    if DEBIAN_TAR.is_file():
        return DEBIAN_TAR
    DEBIAN_TAR.parent.mkdir(parents=True, exist_ok=True)
    root = DEBIAN_TAR.parent / f"root.{os.getpid()}.tmp"
    shutil.rmtree(root, ignore_errors=True)
    try:
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(root),
                        "http://deb.debian.org/debian"], check=True, capture_output=True)
        tmp = DEBIAN_TAR.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["tar", "-C", str(root), "-cf", str(tmp), "."], check=True)
        os.replace(tmp, DEBIAN_TAR)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return DEBIAN_TAR


def base_specs(folder: Path, tar: Path, name: str) -> list[Path]:
    """A layer spec extracting ``tar`` at / and an image spec ``NAME@1`` of that one layer,
    written into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tar, folder / "rootfs.tar")
    (folder / "layer.yaml").write_text(
        f"layer: {name}-root\nversion: '1'\nsteps:\n  - extract: {{src: rootfs.tar, dst: /}}\n")
    (folder / "image.yaml").write_text(
        f"image: {name}\nversion: '1'\nlayers: [{name}-root@1]\n"
        "env: {PATH: /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}\n")
    return [folder / "layer.yaml", folder / "image.yaml"]
