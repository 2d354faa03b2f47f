"""The in-sandbox exec server (`dsec-agent`, static C) and its Python client.

The package build (setup.py) compiles the agent next to its source, tagged with the digest of
the source it was built from, and a wheel ships it; `agent_binary()` finds it and, where no
binary was built (no static libc on the build machine), compiles one once into the data
directory (``data_dir``: DSEC_DATA_DIR or the config's).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from ...core.config import load_config
from ...core.errors import BackendError

SOURCE = Path(__file__).with_name("dsec-agent.c")
#: the file beside a built agent holding the tag of the source it was built from (setup.py)
TAG_FILE = ".dsec-agent.tag"


def _source_tag() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def agent_tag() -> str:
    """The agent's version: a digest of its source (part of a VM template's key, as the saved
    guest runs the agent it booted with)."""
    return _source_tag()


def _built(tag: str) -> Path | None:
    """The agent the package build made from this source, if any."""
    beside = SOURCE.with_name("dsec-agent")
    stamp = SOURCE.with_name(TAG_FILE)
    if beside.is_file() and stamp.is_file() and stamp.read_text().strip() == tag:
        return beside
    return None


def _compiled_path(tag: str) -> Path:
    """Where this source's agent is compiled at run time: the data directory."""
    return Path(load_config().data_dir) / "agent" / f"dsec-agent-{tag}"


@cache
def agent_binary() -> Path:
    """Path of a static dsec-agent built from the current source."""
    tag = _source_tag()
    built = _built(tag) or _compiled_path(tag)
    return built if built.is_file() else _compile(built)


def agent_status() -> dict[str, Any]:
    """Where the agent binary comes from here (`core.compiled` reports it): ``state`` is
    built (by the package build), compiled (at run time, into the data directory), or not
    built (compiled on first use where gcc is installed, else missing)."""
    tag = _source_tag()
    row: dict[str, Any] = {"name": "dsec-agent", "source": "backends/sandbox_agent/dsec-agent.c",
                           "tag": tag}
    built = _built(tag)
    if built is not None:
        return {**row, "state": "built", "live": True, "path": str(built), "detail": ""}
    dest = _compiled_path(tag)
    if dest.is_file():
        return {**row, "state": "compiled", "live": True, "path": str(dest),
                "detail": "compiled at run time into the data directory"}
    how = ("compiled into the data directory on first use" if shutil.which("gcc")
           else "gcc is not installed: sandboxes cannot start")
    return {**row, "state": "not built", "live": False, "path": str(dest), "detail": how}


def _compile(dest: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BackendError("the dsec-agent binary is missing and gcc is not installed",
                           hint="install gcc and libc6-dev, or dsec from a wheel that ships "
                                "the agent")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".agent-")
    os.close(fd)
    proc = subprocess.run([gcc, "-static", "-O2", "-o", tmp, str(SOURCE)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise BackendError(f"compiling dsec-agent failed: {proc.stderr.strip()[-2000:]}",
                           hint="install libc6-dev (static libc) and gcc")
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest


def source_tag() -> str:
    """Identifies the agent build, so per-node artifacts holding a copy can be refreshed."""
    return _source_tag()
