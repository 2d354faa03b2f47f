"""The node protocol: one JSON object per line, both directions, over any byte stream (the
agent's stdio through ``ssh node dsec agent --stdio``).

    client -> node    {"id": 7, "op": "create", "args": {...}}
    node   -> client   {"id": 7, "event": "stdout", "data": "<base64>"}      (exec output, 0..n)
                      {"id": 7, "ok": true, "result": {...}}                 (exactly one)
                      {"id": 7, "ok": false, "error": {"type": "NotFoundError",
                                                        "message": "...", "hint": "..."}}

The first request on a stream must be ``hello`` with the client's protocol version; the node service
answers with its own version and refuses a client of another major version, so a stale node
install is reported as such instead of failing on some later request. Requests carry ids
chosen by the client and may be in flight together; the node service answers each as it finishes.
Bytes (files, output, stdin) travel as base64 strings.

The typed payloads (`CreateOptions`, `ExecResult`, `SandboxRecord`) are encoded by `to_wire`
and decoded by `from_wire`, both derived from the dataclass's fields: every field crosses the
wire, a field added later included, and nothing is written out by hand per field. Decoding is
directed by the field's type; an unknown field or a value of the wrong type is a
`ProtocolError` naming the type and the field, and a field the sender did not know about
(an older client) takes its default.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import types
import typing
from typing import Any, Literal, TypeVar, Union

from ...core import errors as core_errors
from . import errors as cluster_errors
from .errors import ProtocolError

T = TypeVar("T")

PROTOCOL_VERSION = 2  # 2: typed payloads carry every field of their dataclass
MAX_LINE = 64 << 20  # a cp of a large file is one line; refuse anything beyond this


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("a protocol message must be a JSON object")
    return msg


class Lines:
    """A node's byte stream cut into protocol lines, as it arrives, for the threaded and
    the asyncio client alike: `feed` what was read, get the lines it completed. A node is
    hostile like a store object: a line longer than MAX_LINE is refused once that many bytes
    came without a newline (`check_size`), so at most MAX_LINE and one read are held."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        scan = len(buf)
        buf += data
        lines, begin = [], 0
        while (nl := buf.find(b"\n", scan)) >= 0:
            check_size(self.node, nl + 1 - begin)
            lines.append(bytes(buf[begin:nl + 1]))
            begin = scan = nl + 1
        del buf[:begin]
        check_size(self.node, len(buf))
        return lines



def check_size(node: str, size: int) -> None:
    """The bound on one message from a node (a line, or a command's whole reply)."""
    if size > MAX_LINE:
        raise cluster_errors.NodeCommandError(
            f"{node}: the node service sent a message of more than {MAX_LINE} bytes: "
            "dropped the connection", hint="is the node running a dsec node service?")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def error_to_wire(e: BaseException) -> dict[str, Any]:
    if isinstance(e, core_errors.DsecError):
        return {"type": type(e).__name__, "message": e.message, "hint": e.hint,
                "exit_code": e.exit_code}
    return {"type": "DsecError", "message": f"node service error: {type(e).__name__}: {e}",
            "hint": None, "exit_code": 1}


def error_from_wire(err: Any, node: str) -> core_errors.DsecError:
    """The node service's error as the same class here, its message prefixed with the node.

    The node is hostile like any input: a field of the wrong type is dropped, the exit code
    is 1 or 2 whatever it claims (never 0), and the text is kept as it came (the CLI's error
    printer shows its control characters escaped)."""
    if not isinstance(err, dict):
        err = {}
    name, message, hint = (v if isinstance(v, str) else None
                           for v in (err.get("type"), err.get("message"), err.get("hint")))
    code = 2 if err.get("exit_code") == 2 else 1
    cls = getattr(cluster_errors, name or "", None) or getattr(core_errors, name or "", None)
    if not (isinstance(cls, type) and issubclass(cls, core_errors.DsecError)):
        cls = core_errors.UsageError if code == 2 else core_errors.DsecError
    msg = f"{node}: {message or 'unknown error'}"
    try:
        out = cls(msg, hint=hint)
    except TypeError:  # a class with a different constructor: keep the message and code
        out = core_errors.DsecError(msg, hint=hint)
        out.exit_code = code
    return out


# -- typed payloads -----------------------------------------------------------------------------
def to_wire(obj: Any) -> dict[str, Any]:
    """A dataclass instance as a JSON object: every field, bytes as base64."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_wire needs a dataclass instance, not {type(obj).__name__}")
    return {f.name: _enc(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _enc(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return b64(bytes(v))
    if isinstance(v, tuple | list):
        return [_enc(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _enc(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_wire(v)
    return v


def from_wire(cls: type[T], doc: Any) -> T:
    """The dataclass ``cls`` from its wire form; `ProtocolError` for anything that does not
    fit (unknown field, wrong type, required field missing); absent fields take defaults."""
    what = cls.__name__
    if not isinstance(doc, dict):
        raise ProtocolError(f"{what}: expected an object, got {type(doc).__name__}",
                            hint="install the same dsec on both sides")
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ProtocolError(f"{what}: unknown field(s) {', '.join(map(repr, unknown))}",
                            hint="the other side runs another dsec version: install the "
                            "same dsec on both sides")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name in doc:
            kwargs[name] = _dec(hints[name], doc[name], f"{what}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{what}: required field {name!r} is missing",
                                hint="install the same dsec on both sides")
    return cls(**kwargs)


def _bad(where: str, tp: Any, v: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {v!r:.80}",
                         hint="install the same dsec on both sides")


def _dec(tp: Any, v: Any, where: str) -> Any:  # noqa: C901 - one branch per kind of type
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return v
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _dec(a, v, where)
            except ProtocolError:
                continue
        raise _bad(where, tp, v)
    if origin is Literal:
        if v in args:
            return v
        raise ProtocolError(f"{where}: expected one of {list(args)}, got {v!r:.80}")
    if tp is bytes:
        if not isinstance(v, str):
            raise _bad(where, tp, v)
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise _bad(where, tp, v) from None
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise _bad(where, tp, v)
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise _bad(where, tp, v)
    if tp is float:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
        raise _bad(where, tp, v)
    if tp is str:
        if isinstance(v, str):
            return v
        raise _bad(where, tp, v)
    if origin is dict:
        if not isinstance(v, dict):
            raise _bad(where, tp, v)
        kt, vt = args or (str, Any)
        return {_dec(kt, k, where): _dec(vt, x, f"{where}[{k!r}]") for k, x in v.items()}
    if origin in (list, tuple):
        if not isinstance(v, list):
            raise _bad(where, tp, v)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(v) != len(args):
                raise _bad(where, tp, v)
            return tuple(_dec(a, x, f"{where}[{i}]")
                         for i, (a, x) in enumerate(zip(args, v, strict=True)))
        et = args[0] if args else Any
        out = [_dec(et, x, f"{where}[{i}]") for i, x in enumerate(v)]
        return tuple(out) if origin is tuple else out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_wire(tp, v)
    raise TypeError(f"{where}: no wire decoding for type {tp!r}")
