"""The client half of the command server (server.py): what a `dsec exec`, `run -d` or `ps`
call does before anything else. It imports only the interpreter's own C modules (``_socket``,
``_sha256``), no ``socket``, ``json``, ``hashlib`` or ``pathlib``: a served call then costs
little more than Python's own start.

The wire format, one request per connection: the client sends its argv as UTF-8 strings
joined by NUL (an argument never holds one) with its stdin, stdout and stderr as SCM_RIGHTS,
then shuts its side; the server answers ``code N`` (the exit code) or ``fallback`` (run it
in-process). `PROTOCOL` is part of a server's key, so a client never talks to a server of
another format.

Another local user must never get a call's stdio, nor answer in the server's place: the
server's directory is the runtime dir ``cli`` (core/rundir.py: never a ``$XDG_RUNTIME_DIR``
that is not the caller's own), a socket there is connected to only when the caller made it,
and its descriptors are sent only when the process listening runs as the caller's own uid
(SO_PEERCRED). Anything else means the call runs in-process.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from ..core.errors import ConfigError
from ..core.settings import SYSTEM_CONFIG, user_config_path
from ..core.settings import env as settings_env

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


#: the runtime dirs of core/rundir.py, reckoned here with ``os`` calls only (rundir imports
#: pathlib and the error tree, which a served call would pay for); rundir is the source of
#: truth, and tests/security/test_local_user.py holds the two to the same answers
ROOT_RUNTIME = "/run/dsec"
SERVER_DIR_NAME = "cli"


def server_dir() -> str | None:
    """``rundir.runtime_dir("cli")``: the command servers' directory, private to this user
    (created 0700 when missing); None when it, or a directory above it, fails rundir's
    check."""
    override = settings_env("DSEC_RUNTIME_DIR")
    if override:
        if not os.path.isabs(override):
            return None  # in-process, the command itself reports the setting
        root = os.path.abspath(override)
    elif os.geteuid() == 0:
        root = ROOT_RUNTIME
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR") or ""
        if os.path.isabs(xdg) and _ancestors_ok(os.path.join(xdg, "x")) and _private(xdg):
            root = os.path.join(os.path.abspath(xdg), "dsec")
        else:  # none, or another user's (sudo -E, su): passed over
            root = f"/tmp/dsec-{os.geteuid()}"
    d = os.path.join(root, SERVER_DIR_NAME)
    return d if _private_dir(root) and _private_dir(d) else None


def _ancestors_ok(path: str) -> bool:
    """``rundir.check_ancestors``: every directory above ``path`` is root's or ours, and
    sticky where others may write to it."""
    uid = os.geteuid()
    d = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.lstat(d)
        except OSError:
            return False
        if st.st_uid not in (0, uid):
            return False
        if stat.S_ISLNK(st.st_mode):
            if not _ancestors_ok(os.path.join(os.path.realpath(d), "x")):
                return False
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return False
        if d == "/":
            return True
        d = os.path.dirname(d)


def _private_dir(d: str) -> bool:
    """``rundir.private_dir``: ``d`` created 0700 when missing (its missing parents too),
    whether it is a private directory of ours under checked ancestors."""
    try:
        os.lstat(d)
    except FileNotFoundError:
        parent = os.path.dirname(d)
        if parent != d and not os.path.exists(parent) and not _private_dir(parent):
            return False
        if not _ancestors_ok(d):
            return False
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # a racing call of ours, or planted: the check below tells
        except OSError:
            return False
        else:
            os.chmod(d, 0o700)
    except OSError:
        return False
    else:
        if not _ancestors_ok(d):
            return False
    return _private(d)


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
    if d is None:  # a socket anyone else could have put there would get our stdio
        _passed_over("no runtime dir private to this user")
        return None
    key = server_key()
    sock_path = os.path.join(d, f"{key}.sock")
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
    """A connection to the server at ``sock_path`` (in a private dir of ours) when this
    user made the socket and the process listening on it runs as this user."""
    import _socket

    try:
        st = os.lstat(sock_path)
    except OSError:
        return None  # no server yet
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        _passed_over(f"{sock_path} is not a socket this user made")
        return None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        cred = s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    except OSError:
        s.close()
        return None
    uid = int.from_bytes(cred[4:8], sys.byteorder)  # struct ucred: pid, uid, gid
    if uid != os.geteuid():
        s.close()
        _passed_over(f"the server at {sock_path} runs as uid {uid}")
        return None
    return s


def _passed_over(why: str) -> None:
    """A server not used: said at DSEC_LOG=DEBUG (logging is set up only after the server's
    turn, and a served call never imports it)."""
    if (settings_env("DSEC_LOG") or "").upper() == "DEBUG":
        os.write(2, f"DEBUG {__name__}: {why}: running in-process\n".encode(errors="replace"))


def _seen_recently(d: str, key: str, idle: float) -> bool:
    """Whether a call of this environment ran in-process less than ``idle`` seconds ago;
    notes this call."""
    try:
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
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _spawn(d: str, key: str, idle: str) -> bool:
    """Start a server for this environment in the background; whether one is starting (by
    this call, or by another less than `SPAWN_WAIT` ago)."""
    import subprocess

    try:
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
        log = os.open(os.path.join(d, f"{key}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            subprocess.Popen([sys.executable, "-c", code, os.path.join(d, f"{key}.sock"), idle],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True, close_fds=True)
        finally:
            os.close(log)
        return True
    except (OSError, ValueError):
        return False  # no server: every call runs in-process, as with DSEC_CLI_SERVER=0
