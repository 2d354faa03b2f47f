"""The SSH transport: OpenSSH's client, one multiplexed connection per node.

Every node gets a ControlMaster connection (started once, kept for ``DSEC_SSH_PERSIST``
seconds after its last use, shared by every dsec process of the user); each channel is one
``ssh ... dsec agent --stdio`` session over it, so a new CLI call to a warm node costs a
session open, not a TCP connect and key exchange. Host keys are checked against the node's
known_hosts file (``~/.ssh/known_hosts`` unless the node says otherwise) with
``StrictHostKeyChecking=yes``: an unknown or changed key is refused, never trusted.
Authentication is by key only (``BatchMode=yes``: no password prompts).

The control socket's name is a digest of everything that decides whom we trust (user, host,
port, identity, known_hosts file), so a master opened under one known_hosts file is never
reused for a node entry that names another.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import re
import shlex
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...core.config import env, net_timeouts
from ...core.errors import ConfigError, NodeUnreachableError, UsageError
from ...core.rundir import open_own, setting_dir, socket_is_ours
from .errors import HostKeyError, NodeCommandError

log = logging.getLogger(__name__)

_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")
_HOST = re.compile(r"^(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                   r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")
_HOSTKEY_SIGNS = ("Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED",
                  "No ED25519 host key is known", "host key for", "Permission denied",
                  "Too many authentication failures")


@dataclass(frozen=True)
class Address:
    user: str
    host: str
    port: int = 22

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}" + ("" if self.port == 22 else f":{self.port}")


def parse_address(text: str) -> Address:
    """``user@host[:port]`` (``user@[v6]:port`` for IPv6); anything else is a UsageError."""
    user, sep, rest = text.partition("@")
    if not sep or not _USER.match(user):
        raise UsageError(f"malformed node address {text!r}: expected USER@HOST[:PORT]")
    port_text = ""
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")) or ":" not in host:
            raise UsageError(f"malformed node address {text!r}: bad IPv6 literal")
        port_text = tail[1:] if tail else ""
    else:
        host, _, port_text = rest.partition(":")
        if not _HOST.match(host):
            raise UsageError(f"malformed node address {text!r}: bad host name {host!r}")
    port = 22
    if port_text or text.endswith(":"):
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise UsageError(f"malformed node address {text!r}: port must be 1-65535")
        port = int(port_text)
    return Address(user, host, port)


def control_dir() -> Path:
    """Where the control sockets and their lock files live: ``DSEC_SSH_CONTROL_DIR``, else
    the runtime dir ``ssh`` (short: unix socket names are limited to 107 bytes). Either is
    a directory private to the user (core/rundir.py), refused otherwise: a socket another
    user put there would be the node, a symlink there a file we write."""
    return setting_dir("DSEC_SSH_CONTROL_DIR", "ssh")


def _timeout() -> int:
    """Seconds ssh may take to connect and exchange banners: ``DSEC_SSH_TIMEOUT`` if set,
    else the configured connect_timeout (10 s)."""
    raw = env("DSEC_SSH_TIMEOUT")
    if raw:
        if not raw.isdigit() or not 0 < int(raw) <= 3600:
            raise ConfigError(f"$DSEC_SSH_TIMEOUT: {raw!r} must be a whole number of seconds "
                              "between 1 and 3600")
        return int(raw)
    return max(1, math.ceil(net_timeouts().connect))


def _alive_interval() -> int:
    """ssh drops a connection whose server stops answering after 3 unanswered keepalives,
    one every read_timeout / 3 seconds: about read_timeout (20 s) in all."""
    return max(1, math.ceil(net_timeouts().read / 3))


@dataclass(frozen=True)
class SshTarget:
    address: Address
    identity: str | None = None
    known_hosts: str | None = None

    @property
    def known_hosts_file(self) -> str:
        return self.known_hosts or os.path.expanduser("~/.ssh/known_hosts")

    @property
    def control_path(self) -> Path:
        key = "|".join([str(self.address), self.identity or "", self.known_hosts_file])
        return control_dir() / hashlib.sha256(key.encode()).hexdigest()[:20]

    def base_argv(self, master: str = "no") -> list[str]:
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts_file}",
                "-o", f"ConnectTimeout={_timeout()}",
                "-o", f"ServerAliveInterval={_alive_interval()}", "-o", "ServerAliveCountMax=3",
                "-o", f"ControlPath={self.control_path}", "-o", f"ControlMaster={master}",
                "-p", str(self.address.port), "-l", self.address.user]
        ssh_config = env("DSEC_SSH_CONFIG")
        if ssh_config:  # tests: never the developer's ~/.ssh/config
            argv[1:1] = ["-F", ssh_config]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        return argv

    def _check(self) -> bool:
        p = subprocess.run([*self.base_argv(), "-O", "check", self.address.host],
                           capture_output=True, timeout=_timeout())
        return p.returncode == 0

    def ensure_master(self, name: str | None = None) -> None:
        """Start the shared connection unless it runs; maps failures to typed errors.

        The master is started with ``-f`` (it forks once authenticated) and its stderr goes
        to a file, not a pipe: a backgrounded master keeps its stderr open forever."""
        path = self.control_path
        with os.fdopen(open_own(path.parent, f"{path.name}.lock", os.O_RDWR | os.O_CREAT),
                       "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one master per node, however many callers
            if socket_is_ours(path) and self._check():
                return
            who = f"{name} ({self.address})" if name else str(self.address)
            persist = env("DSEC_SSH_PERSIST") or "600"
            with tempfile.TemporaryFile() as err:
                try:
                    p = subprocess.run(
                        [*self.base_argv("yes"), "-o", f"ControlPersist={persist}",
                         # a forward to a node service replaces a dead master's stale socket
                         "-o", "StreamLocalBindUnlink=yes", "-f", "-N",
                         self.address.host], stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=err, timeout=_timeout() + 5)
                except subprocess.TimeoutExpired as e:
                    raise NodeUnreachableError(f"{who}: unreachable: no answer within "
                                               f"{_timeout()}s") from e
                except FileNotFoundError as e:
                    raise UsageError("the OpenSSH client (ssh) is not installed",
                                     hint="apt-get install openssh-client") from e
                err.seek(0)
                text = err.read().decode(errors="replace").strip()
            if p.returncode != 0:
                raise classify(who, text)

    def close_master(self) -> None:
        if self.control_path.exists():
            subprocess.run([*self.base_argv(), "-O", "exit", self.address.host],
                           capture_output=True, timeout=_timeout())

    def forward(self, local: Path, remote: str) -> None:
        """Have the master forward the unix socket ``local`` here to ``remote`` on the node
        (kept while the master lives; asking again for the same forward is harmless). A local
        end that accepts nothing (its file removed or left by a dead master) is dropped and
        set up anew."""
        if not _accepts(local):
            subprocess.run([*self.base_argv(), "-O", "cancel", "-L", f"{local}:{remote}",
                            self.address.host], capture_output=True, timeout=_timeout())
            local.unlink(missing_ok=True)
        p = subprocess.run([*self.base_argv(), "-O", "forward", "-L", f"{local}:{remote}",
                            self.address.host], capture_output=True, timeout=_timeout())
        if p.returncode != 0:
            raise classify(str(self.address), p.stderr.decode(errors="replace") or
                           "the ssh master refused the forward")

    def command_argv(self, remote: list[str]) -> list[str]:
        return [*self.base_argv(), self.address.host, "--", shlex.join(remote)]


def _accepts(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def classify(node: str, stderr: str) -> Exception:
    """ssh exits 255 for every transport failure; its message tells refusals (never
    retried) from unreachability (retried)."""
    tail = stderr.strip().splitlines()[-3:] if stderr.strip() else []
    msg = "; ".join(tail) or "ssh failed"
    if any(s in stderr for s in _HOSTKEY_SIGNS):
        return HostKeyError(f"{node}: refused by SSH: {msg}",
                            hint="check the node's host key in known_hosts and the identity "
                                 "key (dsec never trusts an unknown host key)")
    if "command not found" in stderr or "No such file or directory" in stderr:
        return NodeCommandError(f"{node}: dsec is not installed there: {msg}",
                                hint="dsec node add --bootstrap installs it")
    return NodeUnreachableError(f"{node}: unreachable: {msg}")


