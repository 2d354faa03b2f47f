"""The in-sandbox exec server (`dsec-agent`, static C) and its Python client.

The agent is compiled by scripts/setup.sh next to its source; `agent_binary()` finds it and,
on a machine with gcc where setup has not run yet, builds it once into the data directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from ...core.errors import BackendError

SOURCE = Path(__file__).with_name("dsec-agent.c")


def _source_tag() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def agent_tag() -> str:
    """The agent's version: a digest of its source (part of a VM template's key, as the saved
    guest runs the agent it booted with)."""
    return _source_tag()


@cache
def agent_binary() -> Path:
    """Path of a static dsec-agent built from the current source."""
    tag = _source_tag()
    beside = SOURCE.with_name("dsec-agent")
    stamp = SOURCE.with_name(".dsec-agent.tag")
    if beside.is_file() and stamp.is_file() and stamp.read_text().strip() == tag:
        return beside
    from ...core.config import data_home

    built = data_home() / "agent" / f"dsec-agent-{tag}"
    if built.is_file():
        return built
    return _compile(built)


def _compile(dest: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BackendError("the dsec-agent binary is missing and gcc is not installed",
                           hint="run scripts/setup.sh")
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
