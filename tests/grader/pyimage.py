"""A small Python layer made from this machine's own Debian python3.11, git and pytest (no
download): the interpreter, its standard library without tests and GUI parts, the shared
libraries they load, pytest with its dependencies, and git. Stacked over the busybox layer."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

PYTHON = Path("/usr/bin/python3.11")
STDLIB = Path("/usr/lib/python3.11")
SKIP = {"test", "idlelib", "tkinter", "ensurepip", "lib2to3", "pydoc_data", "turtledemo",
        "site-packages", "dist-packages", "config-3.11-x86_64-linux-gnu"}
PYTEST = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py",
          "pytest-", "pluggy-", "iniconfig-", "packaging-", "pygments-")
BINARIES = [PYTHON, Path("/usr/bin/git")]


def _libraries(paths: list[Path]) -> set[Path]:
    out = set()
    for p in paths:
        r = subprocess.run(["ldd", str(p)], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                out.add(Path(parts[2]))
            elif parts and parts[0].startswith("/"):
                out.add(Path(parts[0]))
    return out


def _site_packages() -> Path:
    import pytest

    return Path(pytest.__file__).resolve().parents[1]


def python_tar(dest: Path) -> Path:
    dynload = sorted((STDLIB / "lib-dynload").glob("*.so"))
    libs = _libraries([*BINARIES, *dynload])

    def skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        stdlib = parts[:3] == ("usr", "lib", "python3.11")
        # bytecode is kept (with the sources' mtimes: the layer keeps them), so a sandbox
        # does not compile the standard library and pytest at every start
        if (stdlib and set(parts[3:]) & SKIP) or (
                info.name.endswith(".pyc") and ".cpython-311" not in info.name):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w", dereference=True) as tf:
        for b in BINARIES:
            tf.add(b, arcname=str(b).lstrip("/"), filter=skip)
        for lib in sorted(libs):
            tf.add(lib, arcname=str(lib).lstrip("/"), filter=skip)
        tf.add(STDLIB, arcname=str(STDLIB).lstrip("/"), filter=skip)
        site = _site_packages()
        for p in sorted(site.iterdir()):
            if p.name.startswith(PYTEST) and "timeout" not in p.name:
                tf.add(p, arcname=f"usr/lib/python3/dist-packages/{p.name}", filter=skip)
        link = tarfile.TarInfo("usr/bin/python3")
        link.type, link.linkname = tarfile.SYMTYPE, "python3.11"
        tf.addfile(link)
    assert sys.version_info[:2] == (3, 11)  # the same minor version as the host's python
    return dest
