"""A minimal QMP client: connect to a VM's control socket, negotiate, run one command.

Only what the backends need (stop, cont, quit, query-status); events are skipped.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from ...core.errors import SandboxError
from ...core.rundir import socket_is_ours


class QMPError(SandboxError):
    """QEMU refused a QMP command or its control socket is gone."""


def qmp(path: str, command: str, arguments: dict[str, Any] | None = None,
        timeout: float = 10.0) -> Any:
    """Run `command` on the QMP socket at `path` and return its ``return`` value. Only a
    socket this user made in a private directory is connected to (core/rundir.py)."""
    if not socket_is_ours(path):
        raise QMPError(f"QMP {command}: {path} is not a socket this user made in a private "
                       "directory: not connecting to it")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            f = s.makefile("rwb")
            _read(f)  # greeting
            for cmd, args in (("qmp_capabilities", None), (command, arguments)):
                msg: dict[str, Any] = {"execute": cmd}
                if args:
                    msg["arguments"] = args
                f.write(json.dumps(msg).encode() + b"\n")
                f.flush()
                reply = _read(f)
            return reply.get("return")
    except OSError as e:
        raise QMPError(f"QMP {command} on {path} failed: {e}") from e


def _read(f: Any) -> dict[str, Any]:
    while True:
        line = f.readline()
        if not line:
            raise QMPError("QEMU closed its control socket")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise QMPError(f"QEMU: {msg['error'].get('desc', msg['error'])}")
        if "event" not in msg:
            return msg
