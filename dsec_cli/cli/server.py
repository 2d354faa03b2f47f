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

Its socket lives in the runtime dir ``cli`` (core/rundir.py), private to the user; the server
serves only clients that run as its own user (SO_PEERCRED), the client only a server that
does (served.py): another local user never gets a call's stdio nor answers in its place.
"""

from __future__ import annotations

import array
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..core.errors import DsecError
from ..core.rundir import UnsafePathError, check_ancestors, check_private, open_own, peer_uid
from .served import decode_request


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

    from . import fast
    from .render import err_console

    path = Path(sock_path)
    try:  # the client checked the dir; checked again where the server writes and listens
        check_ancestors(path.parent)
        check_private(path.parent)
        lock = open_own(path.parent, path.with_suffix(".lock").name, os.O_RDWR | os.O_CREAT)
    except (OSError, UnsafePathError) as e:
        print(f"not serving from {path.parent}: {e}", file=sys.stderr)
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for the process's life
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
            uid = peer_uid(conn)
            if uid != os.geteuid():  # the socket is 0600, and yet: never another user's stdio
                logging.getLogger(__name__).warning("refused a client running as uid %s", uid)
                conn.close()
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
            argv = decode_request(msg)
            if len(fds) != 3 or not msg:
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
                    from .render import print_error

                    print_error(e)
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
            conn.sendall(b"fallback" if code is None else f"code {int(code)}".encode())
        except (OSError, ValueError, KeyError):
            pass  # the client went away, or sent something else: nothing to answer
        finally:
            for fd in fds:
                os.close(fd)
