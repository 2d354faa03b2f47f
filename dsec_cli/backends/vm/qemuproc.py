"""A sandbox's QEMU process and its files: where its sockets and pidfile are (the run dir),
how its process is found again by its ``-name`` when no pid was recorded, and how it is
ended. Shared by the backends (`qemu.py`) and park to a file (`vmpark.py`)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from ...core.errors import ConfigError
from ...core.rundir import check_private, open_beneath, private_dir, runtime_dir
from .qemu_qmp import QMPError, qmp

#: the longest path a unix socket can be bound at (sun_path holds 108 bytes with its NUL)
SOCKET_PATH_MAX = 107
#: a template's boot runs under the sandbox id with this suffix (snapshot boot)
TEMPLATE_SUFFIX = "-tpl"


def proc_start(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def default_state(sid: str, state_dir: str | None) -> dict[str, Any]:
    """Where a sandbox's files are, derived from its id and state dir alone: what destroy
    needs when a crash left no saved handle. The run dir (QMP and agent sockets, pidfile)
    is ``<runtime dir>/vm/<id>`` (core/rundir.py): private to this user, short enough for
    unix socket paths, and the same for the id whatever process asks."""
    run = runtime_dir("vm") / sid
    st: dict[str, Any] = {"run_dir": str(run), "pidfile": str(run / "qemu.pid"),
                          "qmp": str(run / "qmp.sock"), "agent_sock": str(run / "agent.sock")}
    if state_dir:
        sdir = Path(state_dir)
        st.update(state_dir=str(sdir), console=str(sdir / "console.log"),
                  disk=str(sdir / "disk.ext4"), snap_mount=str(sdir / "snap-mnt"))
    return st


def make_run_dir(st: dict[str, Any]) -> Path:
    """The sandbox's run dir, created private (0700, ours): one that is already there and
    another user made or may enter is refused, never used (its sockets may be theirs, and
    QEMU writes its pidfile as root)."""
    for key in ("qmp", "agent_sock"):
        if len(os.fsencode(st[key])) > SOCKET_PATH_MAX:
            raise ConfigError(f"the socket path {st[key]} is longer than {SOCKET_PATH_MAX} "
                              "bytes, the most a unix socket takes",
                              hint="set DSEC_RUNTIME_DIR to a shorter directory")
    return private_dir(st["run_dir"])


def read_pidfile(st: dict[str, Any]) -> int | None:
    """The pid QEMU wrote, read only from a run dir of ours."""
    try:
        check_private(st["run_dir"])
        fd = open_beneath(st["run_dir"], os.path.basename(st["pidfile"]),
                          os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ConfigError):
        return None
    with os.fdopen(fd) as f:
        try:
            return int(f.read(32).strip())
        except (OSError, ValueError):
            return None


def remove_run_dir(run_dir: str) -> None:
    """Remove a run dir that is ours; one another user made is left to them."""
    try:
        check_private(run_dir)
    except ConfigError:
        return
    shutil.rmtree(run_dir, ignore_errors=True)


def template_id(sid: str) -> str:
    return sid + TEMPLATE_SUFFIX


def qemu_name(sid: str) -> bytes:
    return f"dsec-{sid},process=dsec-{sid}".encode()


def find_qemu(sid: str) -> int | None:
    """The pid of this sandbox's QEMU found by its -name, when no pid was recorded."""
    name = qemu_name(sid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"\0" + name + b"\0" in b"\0" + (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


def quit_qemu(qmp_path: str, pid: int, grace: float) -> None:
    """End a QEMU: asked to quit over QMP, killed if it has not gone within ``grace``."""
    try:
        qmp(qmp_path, "quit", timeout=2)
    except QMPError:
        pass
    if not wait_gone(pid, grace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_gone(pid, 10.0)


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_start(pid) is None:
            return True
        time.sleep(0.05)
    return proc_start(pid) is None
