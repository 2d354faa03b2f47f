"""The agent protocol: one JSON object per line, both directions, over any byte stream (the
agent's stdio through ``ssh node dsec agent --stdio``).

    client -> agent   {"id": 7, "op": "create", "args": {...}}
    agent -> client   {"id": 7, "event": "stdout", "data": "<base64>"}      (exec output, 0..n)
                      {"id": 7, "ok": true, "result": {...}}                 (exactly one)
                      {"id": 7, "ok": false, "error": {"type": "NotFoundError",
                                                        "message": "...", "hint": "..."}}

The first request on a stream must be ``hello`` with the client's protocol version; the agent
answers with its own version and refuses a client of another major version, so a stale node
install is reported as such instead of failing on some later request. Requests carry ids
chosen by the client and may be in flight together; the agent answers each as it finishes.
Bytes (files, output, stdin) travel as base64 strings.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from ...core import errors as core_errors
from . import errors as cluster_errors

PROTOCOL_VERSION = 1
MAX_LINE = 64 << 20  # a cp of a large file is one line; refuse anything beyond this


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("a protocol message must be a JSON object")
    return msg


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def error_to_wire(e: BaseException) -> dict[str, Any]:
    if isinstance(e, core_errors.DsecError):
        return {"type": type(e).__name__, "message": e.message, "hint": e.hint,
                "exit_code": e.exit_code}
    return {"type": "DsecError", "message": f"agent error: {type(e).__name__}: {e}",
            "hint": None, "exit_code": 1}


def error_from_wire(err: dict[str, Any], node: str) -> core_errors.DsecError:
    """The agent's error as the same class here, its message prefixed with the node."""
    name = str(err.get("type", "DsecError"))
    cls = getattr(cluster_errors, name, None) or getattr(core_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, core_errors.DsecError)):
        cls = core_errors.UsageError if err.get("exit_code") == 2 else core_errors.DsecError
    msg = f"{node}: {err.get('message', 'unknown error')}"
    try:
        out = cls(msg, hint=err.get("hint"))
    except TypeError:  # a class with a different constructor: keep the message and code
        out = core_errors.DsecError(msg, hint=err.get("hint"))
        out.exit_code = int(err.get("exit_code", 1))
    return out
