"""What an image says about how it runs: the user its commands run as (``oci.user``,
resolved against the image's own /etc/passwd and /etc/group) and the command `dsec run`
starts when given none (``oci.entrypoint`` + ``oci.cmd``, OCI semantics).

The passwd and group files come from the image: hostile input. They are read from the
layer trees without following symlinks, at most MAX_FILE bytes, and a malformed line is
refused with the file and line named."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..backends.base import UserIds
from ..core.errors import UsageError

#: the most of /etc/passwd or /etc/group read from an image
MAX_FILE = 1 << 20
#: the most supplementary groups a user may get (the kernel's NGROUPS_MAX)
MAX_GROUPS = 65536
#: ids above this are refused ((uid_t)-1 means "unchanged" to the kernel)
MAX_ID = 2**32 - 2


@dataclass(frozen=True)
class PasswdEntry:
    name: str
    uid: int
    gid: int
    home: str


@dataclass(frozen=True)
class GroupEntry:
    name: str
    gid: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class ResolvedUser:
    spec: str  # what was asked for, e.g. "app" or "1000:1000"
    ids: UserIds
    home: str | None  # from /etc/passwd, when the user is listed there


def _id(text: str, what: str) -> int:
    if not text.isdigit() or len(text) > 10 or int(text) > MAX_ID:
        raise UsageError(f"invalid {what} {text!r}: expected a number from 0 to {MAX_ID}")
    return int(text)


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def read_image_file(layers_top_first: Sequence[Path], rel: str) -> bytes | None:
    """The bytes of ``rel`` (e.g. "etc/passwd") in the stacked layer trees, top layer
    first; None when no layer has it (or a layer above deleted it). No symlink is followed,
    in the path or as the file itself; more than MAX_FILE bytes is refused."""
    parts = rel.split("/")
    for layer in layers_top_first:
        try:
            fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            found, data = _read_below(fd, parts, rel)
        finally:
            os.close(fd)
        if found:
            return data
    return None


def _read_below(root_fd: int, parts: list[str], rel: str) -> tuple[bool, bytes | None]:
    """(found, data) for ``parts`` below ``root_fd``; found with None data is a whiteout."""
    fd = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False, None
            if _whiteout(st):
                return True, None
            last = i == len(parts) - 1
            if stat.S_ISLNK(st.st_mode):
                raise UsageError(f"the image's /{rel} is reached through a symlink "
                                 f"(/{'/'.join(parts[:i + 1])}): dsec reads it only as a "
                                 "plain file", hint="set the user as UID[:GID] numbers, or "
                                 "give the image a regular /" + rel)
            if not last and not stat.S_ISDIR(st.st_mode):
                return False, None
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            try:
                nfd = os.open(name, flags | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):
                    return False, None
                raise UsageError(f"cannot read the image's /{rel}: {e.strerror}") from e
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"the image's /{rel} is not a regular file")
        if st.st_size > MAX_FILE:
            raise UsageError(f"the image's /{rel} is {st.st_size} bytes: more than the "
                             f"{MAX_FILE} dsec reads")
        data = os.read(fd, MAX_FILE + 1)
        if len(data) > MAX_FILE:
            raise UsageError(f"the image's /{rel} is more than the {MAX_FILE} bytes dsec reads")
        return True, data
    finally:
        os.close(fd)


def _lines(data: bytes, rel: str) -> list[tuple[int, list[str]]]:
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise UsageError(f"the image's /{rel} is not UTF-8 text (byte {e.start})") from e
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip() and not line.startswith("#"):
            out.append((n, line.split(":")))
    return out


def parse_passwd(data: bytes) -> list[PasswdEntry]:
    out = []
    for n, f in _lines(data, "etc/passwd"):
        if len(f) != 7 or not f[0] or not f[2].isdigit() or not f[3].isdigit() \
                or len(f[2]) > 10 or len(f[3]) > 10 or max(int(f[2]), int(f[3])) > MAX_ID:
            raise UsageError(f"the image's /etc/passwd line {n} is malformed: expected "
                             "NAME:PASSWORD:UID:GID:GECOS:HOME:SHELL with numeric ids")
        out.append(PasswdEntry(f[0], int(f[2]), int(f[3]), f[5]))
    return out


def parse_group(data: bytes) -> list[GroupEntry]:
    out = []
    for n, f in _lines(data, "etc/group"):
        if len(f) != 4 or not f[0] or not f[2].isdigit() or len(f[2]) > 10 \
                or int(f[2]) > MAX_ID:
            raise UsageError(f"the image's /etc/group line {n} is malformed: expected "
                             "NAME:PASSWORD:GID:MEMBERS with a numeric gid")
        out.append(GroupEntry(f[0], int(f[2]), tuple(m for m in f[3].split(",") if m)))
    return out


def resolve_user(spec: str, layers_top_first: Sequence[Path]) -> ResolvedUser:
    """``NAME``, ``UID``, ``NAME:GROUP`` or ``UID:GID`` (names and numbers mixed as docker
    takes them) as ids, with the supplementary groups /etc/group gives the user when no
    group is named."""
    if not spec or len(spec) > 256 or any(c in spec for c in "\0\n/") or spec.count(":") > 1:
        raise UsageError(f"invalid user {spec!r}: expected NAME, UID, NAME:GROUP or UID:GID")
    uname, _, gname = spec.partition(":")
    pw_data = read_image_file(layers_top_first, "etc/passwd")
    passwd = parse_passwd(pw_data) if pw_data is not None else []
    entry = next((p for p in passwd if p.name == uname), None)
    if entry is None and uname.isdigit():
        uid = _id(uname, "uid")
        entry = next((p for p in passwd if p.uid == uid), None)
        gid, home, name = (entry.gid, entry.home, entry.name) if entry else (0, None, None)
    elif entry is None:
        raise UsageError(f"user {uname!r} is not in the image's /etc/passwd",
                         hint="give a numeric UID[:GID], or add the user to the image")
    else:
        uid, gid, home, name = entry.uid, entry.gid, entry.home, entry.name
    groups: list[int]
    group: list[GroupEntry] = []
    if gname or name is not None:
        gr_data = read_image_file(layers_top_first, "etc/group")
        group = parse_group(gr_data) if gr_data is not None else []
    if gname:
        g = next((x for x in group if x.name == gname), None)
        if g is not None:
            gid = g.gid
        elif gname.isdigit():
            gid = _id(gname, "gid")
        else:
            raise UsageError(f"group {gname!r} is not in the image's /etc/group",
                             hint="give a numeric gid")
        groups = [gid]
    else:
        groups = [gid] + [g.gid for g in group if name is not None and name in g.members]
    if len(groups) > MAX_GROUPS:
        raise UsageError(f"user {spec!r} is in {len(groups)} groups in the image's "
                         f"/etc/group: more than {MAX_GROUPS}")
    return ResolvedUser(spec, UserIds(uid, gid, tuple(dict.fromkeys(groups))), home)


def annotated_list(annotations: dict[str, str], key: str) -> list[str] | None:
    """``oci.entrypoint`` / ``oci.cmd``: a JSON list of strings, or None when absent."""
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise UsageError(f"the image's {key} annotation is not JSON") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"the image's {key} annotation is not a list of strings")
    return value


def command(entrypoint: list[str] | None, cmd: list[str] | None, given: list[str] | None,
            entrypoint_override: str | None = None) -> list[str]:
    """What `dsec run` starts (OCI semantics): the entrypoint (or ``--entrypoint``; "" for
    none) followed by the given command, else the image's cmd (dropped when the entrypoint
    was overridden)."""
    if entrypoint_override is not None:
        head = [entrypoint_override] if entrypoint_override else []
        return head + list(given or [])
    return list(entrypoint or []) + list(given if given else cmd or [])


def image_command(annotations: dict[str, str]) -> dict[str, list[str]]:
    """The image's entrypoint and cmd, as a sandbox record keeps them (absent keys: none)."""
    out = {}
    for key in ("entrypoint", "cmd"):
        value = annotated_list(annotations, "oci." + key)
        if value is not None:
            out[key] = value
    return out
