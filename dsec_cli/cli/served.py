"""The client half of the command server (server.py): what a `dsec exec`, `run -d` or `ps`
call does before anything else. It imports only the interpreter's own C modules (``_socket``,
``_sha256``), no ``socket``, ``json``, ``hashlib`` or ``pathlib``: a served call then costs
little more than Python's own start.

The wire format, one request per connection: the client sends its argv as UTF-8 strings
joined by NUL (an argument never holds one) with its stdin, stdout and stderr as SCM_RIGHTS,
then shuts its side; the server answers ``code N`` (the exit code) or ``fallback`` (run it
in-process). `PROTOCOL` is part of a server's key, so a client never talks to a server of
another format.
"""

from __future__ import annotations

import os
import sys

from ..core.settings import SYSTEM_CONFIG, user_config_path

PROTOCOL = 2
#: environment variables that vary between calls without changing what a command does
_VOLATILE = ("_", "OLDPWD", "SHLVL")
#: seconds a server started on demand stays idle when DSEC_CLI_SERVER is not set
DEFAULT_IDLE = 30.0
#: seconds after a client started a server during which others do not start another
SPAWN_WAIT = 5.0
#: seconds a call that finds a server starting waits for it before running in-process
START_WAIT = 2.0
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def server_dir() -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"dsec-cli-{os.getuid()}")


def _stamp(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def _sha256_hex(data: bytes) -> str:
    try:
        from _sha256 import sha256  # the interpreter's own: hashlib loads OpenSSL first
    except ImportError:
        from hashlib import sha256
    return sha256(data).hexdigest()


def server_key() -> str:
    """What a server's behaviour depends on: the environment, the working directory, the
    install, and the config files as they are now (an edited config means a new server)."""
    env = sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE)
    files = [_stamp(p) for p in (SYSTEM_CONFIG, user_config_path(), "dsec.yaml")]
    doc = repr([PROTOCOL, env, os.getcwd(), sys.executable, PACKAGE_ROOT, os.getuid(),
                os.umask(os.umask(0o022)), files])
    return _sha256_hex(doc.encode("utf-8", "surrogateescape"))[:20]


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


def encode_request(argv: list[str]) -> bytes:
    return b"\0".join(a.encode() for a in argv)


def decode_request(msg: bytes) -> list[str]:
    return msg.decode().split("\0")


def try_run(argv: list[str], idle: str, eager: bool = True) -> int | None:
    """Run ``argv`` on this environment's server: its exit code, or None when there is no
    server or it does not take this command line. Without a server, one is started for the
    next calls (``eager``), or when a call of this environment came within the idle time."""
    if not _local(argv) or any("\0" in a for a in argv):
        return None
    d = server_dir()
    key = server_key()
    sock_path = os.path.join(d, f"{key}.sock")
    if not _private(d):  # a socket anyone else could have put there would get our stdio
        if eager or _seen_recently(d, key, float(idle)):
            _spawn(d, key, idle)
        return None
    s = _connect(sock_path)
    if s is None:
        if not (eager or _seen_recently(d, key, float(idle))) or not _spawn(d, key, idle):
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
    import _socket

    try:
        fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2))
        try:
            s.sendmsg([encode_request(argv)], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
            s.shutdown(_socket.SHUT_WR)
        except OSError:  # a closed stdin, a server dying as we came: nothing was sent
            return None
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    finally:
        s.close()
    if not data:
        raise ServerGone()
    if data == b"fallback":
        return None
    word, _, code = data.partition(b" ")
    try:
        if word == b"code":
            return int(code)
    except ValueError:
        pass
    raise ServerGone()  # not an answer this client knows: treated as no answer


def _connect(sock_path: str):  # type: ignore[no-untyped-def]  # an _socket.socket or None
    import _socket

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        return s
    except OSError:
        s.close()
        return None


def _seen_recently(d: str, key: str, idle: float) -> bool:
    """Whether a call of this environment ran in-process less than ``idle`` seconds ago;
    notes this call."""
    import time

    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if not _private(d):
            return False
        seen = os.path.join(d, f"{key}.seen")
        try:
            recent = time.time() - os.stat(seen).st_mtime < idle
        except OSError:
            recent = False
        os.close(os.open(seen, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        os.utime(seen)
        return recent
    except OSError:
        return False


def _private(d: str) -> bool:
    """``d`` is a real directory that only this user can write to (and so holds only
    sockets this user made)."""
    import stat

    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _spawn(d: str, key: str, idle: str) -> bool:
    """Start a server for this environment in the background; whether one is starting (by
    this call, or by another less than `SPAWN_WAIT` ago)."""
    import subprocess
    import time

    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if not _private(d):
            return False  # not a directory private to us: never serve from it
        # many clients finding no server at once start one, not one each (the others would
        # only find its lock taken and exit)
        started = os.path.join(d, f"{key}.spawn")
        try:
            if time.time() - os.stat(started).st_mtime < SPAWN_WAIT:
                return True
        except OSError:
            pass
        os.close(os.open(started, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600))
        os.utime(started)
        code = (f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r}); "
                "from dsec_cli.cli.server import serve; serve(sys.argv[1], float(sys.argv[2]))")
        with open(os.path.join(d, f"{key}.log"), "ab") as log:
            subprocess.Popen([sys.executable, "-c", code, os.path.join(d, f"{key}.sock"), idle],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True, close_fds=True)
        return True
    except (OSError, ValueError):
        return False  # no server: every call runs in-process, as with DSEC_CLI_SERVER=0
