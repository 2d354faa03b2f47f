"""Runtime directories private to the effective user: where sockets, pidfiles and lock files
live that another local user must neither plant nor swap.

A directory is used only when ``lstat`` shows a real directory (never a symlink) owned by
the effective uid with no group or other bits, and every directory above it is owned by root
or that uid and, where others may write to it, sticky (so nobody else can rename an entry
away and put their own in its place), the check OpenSSH makes of its key files' paths. A
directory that is missing is created 0700; one that fails the check is refused, never
repaired: a planted directory may already hold the planter's sockets.

Where runtime dirs live (`runtime_dir`): under ``$DSEC_RUNTIME_DIR`` when set (it must pass
the same check); else root's under ``/run/dsec``; another user's under
``$XDG_RUNTIME_DIR`` when that passes the same check (under ``sudo -E`` or ``su`` it is
another user's, and is passed over), else under ``/tmp/dsec-<uid>``.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import ConfigError
from .settings import env

#: root's runtime dirs: /run is root's own and cleared at boot
ROOT_RUNTIME = "/run/dsec"


class UnsafePathError(ConfigError):
    """A runtime directory or socket that another user could have made or could swap."""


def _refuse(path: Path | str, why: str) -> UnsafePathError:
    return UnsafePathError(f"{path}: {why}",
                           hint="remove it (another user may have made it), or point dsec "
                                "at a directory of your own")


def check_ancestors(path: Path | str) -> None:
    """Every directory above ``path`` is owned by root or the effective uid, and sticky
    where others may write to it."""
    uid = os.geteuid()
    p = Path(os.path.abspath(path)).parent
    for d in (p, *p.parents):
        try:
            st = os.lstat(d)
        except OSError as e:
            raise _refuse(d, f"cannot be checked ({e.strerror})") from e
        if stat.S_ISLNK(st.st_mode):
            # a symlink in the chain is followed only when root (or we) made it in a place
            # nobody else can write: the target's chain is then checked on its own
            if st.st_uid not in (0, uid):
                raise _refuse(d, "is a symlink another user owns")
            check_ancestors(os.path.join(os.path.realpath(d), "x"))
            continue
        if st.st_uid not in (0, uid):
            raise _refuse(d, f"is owned by uid {st.st_uid}, not root or uid {uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _refuse(d, "may be written by other users and is not sticky")


def check_private(path: Path | str) -> os.stat_result:
    """``path`` is a real directory of the effective uid that no one else may enter."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise _refuse(path, f"cannot be checked ({e.strerror})") from e
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory (a symlink or a file was put there)")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"is owned by uid {st.st_uid}, not uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise _refuse(path, f"has mode {stat.S_IMODE(st.st_mode):o}, not private (0700)")
    return st


def private_dir(path: Path | str) -> Path:
    """``path`` as a private directory: created 0700 when missing (its missing parents
    too, each private), checked when present, refused when another user could reach it."""
    p = Path(os.path.abspath(path))
    try:
        os.lstat(p)
    except FileNotFoundError:
        if not p.parent.exists() and p.parent != p:
            private_dir(p.parent)
        check_ancestors(p)
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # made by a racing call of ours, or planted: the check below tells
        else:
            os.chmod(p, 0o700)  # whatever the umask
    else:
        check_ancestors(p)
    check_private(p)
    return p


def _xdg_runtime() -> Path | None:
    """``$XDG_RUNTIME_DIR`` when it is the effective user's own, else None."""
    raw = os.environ.get("XDG_RUNTIME_DIR")
    if not raw or not os.path.isabs(raw):
        return None
    try:
        check_ancestors(Path(raw) / "x")
        check_private(raw)
    except UnsafePathError:
        return None
    return Path(raw)


def runtime_root() -> Path:
    """The effective user's private runtime directory (created on first use)."""
    override = env("DSEC_RUNTIME_DIR")
    if override:
        if not os.path.isabs(override):
            raise ConfigError(f"$DSEC_RUNTIME_DIR: {override!r} must be an absolute path")
        return private_dir(override)
    if os.geteuid() == 0:
        return private_dir(ROOT_RUNTIME)
    xdg = _xdg_runtime()
    if xdg is not None:
        return private_dir(xdg / "dsec")
    return private_dir(Path("/tmp") / f"dsec-{os.geteuid()}")


def runtime_dir(name: str) -> Path:
    """A private directory ``name`` under the user's runtime root."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad runtime dir name {name!r}")
    return private_dir(runtime_root() / name)


def open_beneath(dirpath: Path | str, name: str, flags: int, mode: int = 0o600) -> int:
    """Open ``name`` in the private directory ``dirpath`` without following a symlink
    there (``O_NOFOLLOW`` relative to the directory's own fd)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad file name {name!r}")
    dfd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    finally:
        os.close(dfd)


def socket_is_ours(path: Path | str) -> bool:
    """A unix socket at ``path`` that the effective user made, in a private directory."""
    try:
        st = os.lstat(path)
        check_private(os.path.dirname(os.path.abspath(path)))
    except (OSError, UnsafePathError):
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()


def peer_uid(sock: object) -> int | None:
    """The uid of the process at the other end of a connected unix socket (SO_PEERCRED)."""
    import socket
    import struct

    assert isinstance(sock, socket.socket)
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", raw)
    return uid


def open_own(dirpath: Path | str, name: str, flags: int, mode: int = 0o600) -> int:
    """`open_beneath`, with a symlink found at ``name`` refused as an `UnsafePathError`
    naming it: only dsec's own files belong in a private directory."""
    try:
        return open_beneath(dirpath, name, flags, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise UnsafePathError(f"{os.path.join(dirpath, name)}: is a symlink, not a file "
                              "dsec made", hint="remove it (another user may have put it "
                                                "there)") from e


def setting_dir(setting: str, name: str) -> Path:
    """The private directory a ``DSEC_*`` setting names (absolute, passing
    `private_dir`'s check), else the runtime dir ``name``."""
    raw = env(setting)
    if not raw:
        return runtime_dir(name)
    if not os.path.isabs(raw):
        raise ConfigError(f"${setting}: {raw!r} must be an absolute path")
    return private_dir(raw)
