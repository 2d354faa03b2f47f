"""The command server: a per-user process that keeps dsec imported and runs the plain hot
commands on this node (fast.py: `exec ID -- CMD`, `run -d`, `ps`; not the ``--node`` forms,
which reach a node's own resident service) for short-lived `dsec` processes, which then cost
little more than Python's own start. On by default: ``DSEC_CLI_SERVER`` is the seconds a
server may stay idle (default 30); ``0`` or ``off`` runs every command in-process.

A client connects to the server's unix socket and passes its stdin, stdout and stderr along
(SCM_RIGHTS) with its argv; the server runs the command on those descriptors (output streams
straight to the client's terminal or pipe, stdin is read from the client's, log messages go
to the client's stderr) and answers with the exit code. The server's socket is named by a
digest of the client's whole environment, working directory, dsec install and config files
(their size and time), so a command always runs as it would in-process. A client interrupted
(Ctrl-C) stops waiting; the command it sent runs on in the server to its end or its
``--timeout``.

Started on demand: a call that finds no server runs in-process, unless a call of the same
environment came less than the idle time before it (or ``DSEC_CLI_SERVER`` is set): then it
starts one in the background, or finds one starting, and waits up to `START_WAIT` for it
(less than its own imports would cost; in a burst, all callers wait for one server instead
of all running in-process). So a one-off command never leaves a process.
Safe to kill: no server (or a dead one) means the command runs in-process; a server killed
while running a command makes that one call fail with a clear message (it is never run
twice), and the next call starts a new server. A server exits after the idle time, removing
its socket.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

#: environment variables that vary between calls without changing what a command does
_VOLATILE = ("_", "OLDPWD", "SHLVL")
#: seconds a server started on demand stays idle when DSEC_CLI_SERVER is not set
DEFAULT_IDLE = 30.0
#: seconds after a client started a server during which others do not start another
SPAWN_WAIT = 5.0
#: seconds a call that finds a server starting waits for it before running in-process
START_WAIT = 2.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def server_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"dsec-cli-{os.getuid()}"


def _stamp(path: Path) -> list[int]:
    try:
        st = path.stat()
    except OSError:
        return []
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def server_key() -> str:
    """What a server's behaviour depends on: the environment, the working directory, the
    install, and the config files as they are now (an edited config means a new server)."""
    from ..core.config import SYSTEM_FILE, user_config_file

    env = sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE)
    files = [_stamp(p) for p in (SYSTEM_FILE, user_config_file(), Path("dsec.yaml"))]
    doc = json.dumps([env, os.getcwd(), sys.executable, _PACKAGE_ROOT, os.getuid(),
                      os.umask(os.umask(0o022)), files])
    return hashlib.sha256(doc.encode()).hexdigest()[:20]


# -- client -------------------------------------------------------------------------------------
class ServerGone(Exception):
    """The server accepted the command, then went away before answering."""


def idle_seconds(setting: str | None) -> str | None:
    """The idle time ``DSEC_CLI_SERVER`` asks for (unset: the default), None when it turns
    the server off."""
    if setting is None:
        return f"{DEFAULT_IDLE:g}"
    if setting.strip().lower() in ("0", "off", "no", "false", ""):
        return None
    try:
        ok = 0 < float(setting) < 1e9
    except ValueError:
        ok = False
    if not ok:
        from ..core.errors import ConfigError

        raise ConfigError(f"$DSEC_CLI_SERVER: {setting!r} must be the seconds a command "
                          "server may stay idle (a number above 0), or 0 / off for none")
    return setting


def _local(argv: list[str]) -> bool:
    """The command works on this node's sandboxes (a ``--node`` form goes to that node's
    resident service from this process)."""
    opts = argv[:argv.index("--")] if "--" in argv else argv
    return not any(a in ("--node", "--all-nodes") or a.startswith("--node=") for a in opts)


def try_run(argv: list[str], idle: str, eager: bool = True) -> int | None:
    """Run ``argv`` on this environment's server: its exit code, or None when there is no
    server or it does not take this command line. Without a server, one is started for the
    next calls (``eager``), or when a call of this environment came within the idle time."""
    if not _local(argv):
        return None
    d = server_dir()
    key = server_key()
    sock_path = d / f"{key}.sock"
    if not _private(d):  # a socket anyone else could have put there would get our stdio
        if eager or _seen_recently(d, key, float(idle)):
            _spawn(d, sock_path, idle)
        return None
    s = _connect(sock_path)
    if s is None:
        if not (eager or _seen_recently(d, key, float(idle))) or \
                not _spawn(d, sock_path, idle):
            return None
        # a server is starting: waiting for it costs less than this command's own imports
        # (and, in a burst of calls, than every caller running in-process at once)
        import time

        deadline = time.monotonic() + START_WAIT
        while s is None and time.monotonic() < deadline:
            time.sleep(0.02)
            s = _connect(sock_path)
        if s is None:
            return None
    with s:
        msg = json.dumps({"argv": argv}).encode()
        fds = array.array("i", [0, 1, 2])
        try:
            s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            s.shutdown(socket.SHUT_WR)
        except OSError:  # a closed stdin, a server dying as we came: nothing was sent
            return None
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    if not data:
        raise ServerGone()
    answer = json.loads(data)
    return None if answer.get("fallback") else int(answer["code"])


def _connect(sock_path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock_path))
        return s
    except OSError:
        s.close()
        return None


def _seen_recently(d: Path, key: str, idle: float) -> bool:
    """Whether a call of this environment ran in-process less than ``idle`` seconds ago;
    notes this call."""
    import time

    try:
        d.mkdir(mode=0o700, exist_ok=True)
        if not _private(d):
            return False
        seen = d / f"{key}.seen"
        try:
            recent = time.time() - seen.stat().st_mtime < idle
        except OSError:
            recent = False
        os.close(os.open(seen, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        os.utime(seen)
        return recent
    except OSError:
        return False


def _private(d: Path) -> bool:
    """``d`` is a real directory that only this user can write to (and so holds only
    sockets this user made)."""
    try:
        st = d.lstat()
    except OSError:
        return False
    import stat

    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _spawn(d: Path, sock_path: Path, idle: str) -> bool:
    """Start a server for this environment in the background; whether one is starting (by
    this call, or by another less than `SPAWN_WAIT` ago)."""
    import subprocess
    import time

    try:
        d.mkdir(mode=0o700, exist_ok=True)
        if not _private(d):
            return False  # not a directory private to us: never serve from it
        # many clients finding no server at once start one, not one each (the others would
        # only find its lock taken and exit)
        started = d / f"{sock_path.stem}.spawn"
        try:
            if time.time() - started.stat().st_mtime < SPAWN_WAIT:
                return True
        except OSError:
            pass
        os.close(os.open(started, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600))
        os.utime(started)
        code = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
                "from dsec_cli.cli.server import serve; serve(sys.argv[1], float(sys.argv[2]))")
        with open(d / f"{sock_path.stem}.log", "ab") as log:
            subprocess.Popen([sys.executable, "-c", code, str(sock_path), idle],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True, close_fds=True)
        return True
    except (OSError, ValueError):
        return False  # no server: every call runs in-process, as with DSEC_CLI_SERVER=0


# -- server -------------------------------------------------------------------------------------
class _ThreadStream:
    """``sys.stdin``/``stdout``/``stderr`` of the server: each request thread's own client
    stream, or the server's own outside requests."""

    def __init__(self, name: str, default: Any) -> None:
        import threading

        self._name = name
        self._default = default
        self._local = threading.local()

    def bind(self, stream: Any) -> None:
        self._local.stream = stream

    def __getattr__(self, attr: str) -> Any:
        return getattr(getattr(self._local, "stream", None) or self._default, attr)


def serve(sock_path: str, idle: float) -> None:
    """Serve until idle for ``idle`` seconds (or killed)."""
    import fcntl
    import logging
    import threading
    import time

    from . import fast
    from .render import err_console

    path = Path(sock_path)
    lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another server of this environment is starting or running
    import dsec_cli.api.sandboxes  # noqa: F401 - imported once here, not per call

    streams = {n: _ThreadStream(n, getattr(sys, n)) for n in ("stdin", "stdout", "stderr")}
    for n, proxy in streams.items():
        setattr(sys, n, proxy)
    # a command's log messages go to its client's stderr, as in-process; the server's own
    # (a pool refill in the background) to the server's log
    from ..core.config import env

    level = (env("DSEC_LOG") or "WARNING").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "WARNING",
                        format="%(levelname)s %(name)s: %(message)s", stream=streams["stderr"])
    path.unlink(missing_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    os.chmod(sock_path, 0o600)
    srv.listen(64)
    srv.settimeout(min(idle, 5.0))
    state = {"busy": 0, "last": time.monotonic()}
    guard = threading.Lock()

    def one(conn: socket.socket) -> None:
        try:
            _handle(conn, streams, fast, err_console)
        finally:
            with guard:
                state["busy"] -= 1
                state["last"] = time.monotonic()
                if not state["busy"]:
                    _between_commands()

    try:
        while True:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                with guard:
                    if not state["busy"]:
                        _reap()
                        if time.monotonic() - state["last"] >= idle:
                            return
                continue
            conn.settimeout(None)
            with guard:
                state["busy"] += 1
            threading.Thread(target=one, args=(conn,), daemon=True).start()
    finally:
        srv.close()
        path.unlink(missing_ok=True)


def _between_commands() -> None:
    """What an exiting CLI process leaves behind, done while no command runs: connections
    to sandboxes closed (a VM's agent takes one at a time: another process's command must
    get it), ended children collected."""
    from ..api.sandboxes import drop_connections

    drop_connections()
    _reap()


def _reap() -> None:
    """Collect the children that have ended: sandbox processes and mount daemons a command
    started here and another process removed (an exiting CLI process leaves them to init).
    Called only while no command runs, so no command's own wait loses its child."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _handle(conn: socket.socket, streams: dict[str, _ThreadStream], fast: Any,
            err_console: Any) -> None:
    from ..core.errors import DsecError

    with conn:
        fds: list[int] = []
        try:
            # close-on-exec from the start: a process a command starts (a sandbox) must never
            # inherit the client's stdio (it would hold the client's pipes open, or reach them)
            msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4),
                                          socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", data[:len(data) - len(data) % 4]).tolist()
            argv = json.loads(msg)["argv"]
            if len(fds) != 3 or not isinstance(argv, list):
                return
            files = [os.fdopen(fds[0], "r", closefd=True),
                     os.fdopen(fds[1], "w", closefd=True),
                     os.fdopen(fds[2], "w", closefd=True)]
            fds = []
            for name, f in zip(("stdin", "stdout", "stderr"), files, strict=True):
                streams[name].bind(f)
            try:
                try:
                    code = fast.run(argv)
                except DsecError as e:
                    from . import _print_error

                    _print_error(e)
                    code = e.exit_code
                for f in files[1:]:
                    f.flush()
                # pool members the command took are replaced before it answers, as an
                # exiting CLI process does: no refill runs on in the server between commands
                from ..api.pools import finish_refills

                finish_refills()
            finally:
                for name in streams:
                    streams[name].bind(None)
                for f in files:
                    try:
                        f.close()
                    except OSError:
                        pass
            conn.sendall(json.dumps({"fallback": True} if code is None else
                                    {"code": code}).encode())
        except (OSError, ValueError, KeyError):
            pass  # the client went away, or sent something else: nothing to answer
        finally:
            for fd in fds:
                os.close(fd)
