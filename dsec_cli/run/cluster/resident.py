"""The resident node service: one long-lived `dsec agent` per node environment, serving the
node protocol on a unix socket, so that a client call costs a connection over the node's SSH
master (forwarded to that socket) instead of an SSH session and a Python start on the node.

``dsec agent --resident`` makes sure it runs and prints where it listens, as one JSON line
``{"socket": PATH, "pid": N, "protocol": V}``; the client forwards a local socket to PATH over
its SSH master (remote.py). Under a lock it asks the socket's service for ``hello``; if none
answers (never started, killed, frozen) it stops what the pid file names and starts a new
one, detached in its own session, and waits until that one answers.

One service serves one environment: the socket's name is a digest of the dsec version, the
protocol version, the Python and package that run it, its state dir and the ``DSEC_*`` /
``XDG_*`` settings, so clients whose sessions set up the node differently (another state dir,
another install) never share one. The files live in ``DSEC_AGENT_DIR`` (default the runtime
dir ``node``, core/rundir.py), a directory private to the user and refused otherwise; a
socket there is used only when this user made it and the process listening on it runs as
this user (SO_PEERCRED), and the service answers only clients of its own user.
A service with no client for ``DSEC_AGENT_IDLE`` seconds (900) exits and removes its socket
and pid file; sandboxes do not depend on it (their supervisors own them), so stopping it at
any time, ``kill -9`` included, loses nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ... import __version__
from ...backends import _rootfs
from ...core.config import env
from ...core.errors import ConfigError, DsecError
from ...core.rundir import open_own, peer_uid, setting_dir, socket_is_ours
from .protocol import PROTOCOL_VERSION, decode, encode

log = logging.getLogger(__name__)

#: how long a starting service may take to answer its first hello
START_TIMEOUT = 60.0
#: how long a running service may take to answer a probe before it counts as hung
PROBE_TIMEOUT = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding dsec_cli


def agent_dir() -> Path:
    """The user's private directory of resident services (created 0700; refused when another
    user made it or could swap it: a socket there is the node)."""
    return setting_dir("DSEC_AGENT_DIR", "node")


def idle_seconds() -> float:
    raw = env("DSEC_AGENT_IDLE") or "900"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"$DSEC_AGENT_IDLE: {raw!r} must be a number of seconds above 0")
    return value


def service_key(state_dir: str | None) -> str:
    """What decides which service a session may share (see the module docstring)."""
    settings = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith(("DSEC_", "XDG_")) or k == "PYTHONPATH")
    doc = json.dumps([__version__, PROTOCOL_VERSION, sys.executable, _PACKAGE_ROOT,
                      state_dir, settings])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def probe(sock: Path, timeout: float = PROBE_TIMEOUT) -> dict[str, Any] | None:
    """The service's hello answer on ``sock``, or None when nothing answers in time."""
    if not socket_is_ours(sock):
        return None  # none yet, or not this user's: a service started anew replaces it
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(sock))
            if peer_uid(s) != os.geteuid():
                log.warning("%s: the process listening runs as another user: not used", sock)
                return None
            s.sendall(encode({"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION}}))
            with s.makefile("rb") as r:
                msg = decode(r.readline())
    except (OSError, ValueError):
        return None
    if not msg.get("ok"):
        return None
    result = msg.get("result")
    return result if isinstance(result, dict) else None


def _stop_stale(pidfile: Path) -> None:
    """Kill the service a pid file names if it still runs (hung: it did not answer)."""
    try:
        fd = open_own(pidfile.parent, pidfile.name, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        with os.fdopen(fd) as f:
            pid_text, start_text = f.read().split()
        pid, start = int(pid_text), int(start_text)
    except (OSError, ValueError):
        return
    if _rootfs.alive(pid, start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def ensure(state_dir: str | None = None) -> dict[str, Any]:
    """Make sure this environment's resident service answers; where it listens."""
    idle_seconds()  # a bad setting is refused here, not by a service that dies at start
    d = agent_dir()
    key = service_key(state_dir)
    sock, pidfile = d / f"{key}.sock", d / f"{key}.pid"
    with os.fdopen(open_own(d, f"{key}.lock", os.O_RDWR | os.O_CREAT), "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one service per key, however many starters
        info = probe(sock)
        if info is None:
            _stop_stale(pidfile)
            info = _start(sock, pidfile, d / f"{key}.log", state_dir)
    return {"socket": str(sock), "pid": info.get("pid"), "protocol": info.get("protocol")}


def _start(sock: Path, pidfile: Path, logfile: Path, state_dir: str | None) -> dict[str, Any]:
    code = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
            "from dsec_cli.run.cluster.resident import serve; serve(sys.argv[1:])")
    argv = [sys.executable, "-c", code, str(sock), str(pidfile), state_dir or ""]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(open_own(logfile.parent, logfile.name, flags), "wb") as log_out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_out, stderr=log_out,
                                start_new_session=True, close_fds=True)  # outlives this session
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        info = probe(sock, timeout=1.0)
        if info is not None and info.get("pid") == proc.pid:
            return info
        rc = proc.poll()
        if rc is not None:
            tail = logfile.read_bytes()[-2000:].decode(errors="replace").strip()
            raise DsecError(f"the resident node service exited with status {rc} at start: "
                            f"{tail or 'no output'}", hint=f"its log: {logfile}")
        if time.monotonic() > deadline:
            proc.kill()
            raise DsecError(f"the resident node service did not answer within "
                            f"{START_TIMEOUT:g}s", hint=f"its log: {logfile}")
        time.sleep(0.05)


def serve(args: list[str]) -> None:
    """The resident service's own process: ``SOCKET PIDFILE STATE_DIR``."""
    from .node_service import serve_unix

    sock, pidfile, state_dir = args
    level = (env("DSEC_LOG") or "WARNING").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "WARNING",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pid = os.getpid()
    pidpath = Path(pidfile)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(open_own(pidpath.parent, pidpath.name, flags), "w") as f:
        f.write(f"{pid} {_rootfs.proc_start_time(pid)}\n")
    try:
        serve_unix(sock, state_dir or None, idle=idle_seconds())
    finally:
        with contextlib.suppress(OSError, ValueError):
            if int(Path(pidfile).read_text().split()[0]) == pid:
                Path(pidfile).unlink()
