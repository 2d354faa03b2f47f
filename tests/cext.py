"""Compiled parts under test: each test module builds its C source afresh, with warnings as
errors, into a temporary directory and loads it, so a test never depends on what set-up left
beside the source (an older build, or none)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType


def build_and_load(src: Path, out_dir: Path) -> ModuleType:
    """Compile ``src`` (a CPython extension, module name = its stem) and import it."""
    name = src.stem
    out = out_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC",
                    f"-I{sysconfig.get_paths()['include']}", "-o", str(out), str(src)],
                   check=True)
    loader = importlib.machinery.ExtensionFileLoader(name, str(out))
    spec = importlib.util.spec_from_file_location(name, out, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod
