"""The node protocol's typed payloads: every field of CreateOptions, ExecResult and
SandboxRecord crosses the wire and comes back equal, an unknown field is refused, a missing
one takes its default; and `dsec run --node N --fetch lazy` really runs lazily there."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal

import pytest

from dsec_cli.backends.base import ExecResult
from dsec_cli.run.cluster.errors import ProtocolError
from dsec_cli.run.cluster.protocol import from_wire, to_wire
from dsec_cli.run.node import CreateOptions
from dsec_cli.run.state import SandboxRecord

from .conftest import IMAGE
from .sshnodes import SshCluster

PAYLOADS = [CreateOptions, ExecResult, SandboxRecord]


def _other(tp: Any, default: Any, name: str) -> Any:
    """A value of type ``tp`` that differs from ``default`` (and from other fields' values)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return next(a for a in args if a != default)
    if args and type(None) in args:  # X | None
        return _other(next(a for a in args if a is not type(None)), default, name)
    if tp is bool:
        return not default
    if tp is int:
        return (default or 0) + 1000 + len(name)
    if tp is float:
        return (default or 0.0) + 0.5 + len(name)
    if tp is str:
        return f"{default}-{name}-é"
    if tp is bytes:
        return b"\x00\xff" + name.encode()
    if origin is dict:
        return {"k-" + name: "v=1" if args[1] is str else {"nested": [1, 2.5, None]}}
    if origin is list:
        return [f"{name}-a", f"{name}-b"]
    raise AssertionError(f"no test value for {name}: {tp!r}; extend _other")


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


@pytest.mark.parametrize("cls", PAYLOADS, ids=lambda c: c.__name__)
def test_every_field_crosses_the_wire(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    defaults = _defaults(cls)
    for f in dataclasses.fields(cls):
        base = {k: (v if v is not None else _other(hints[k], None, k))
                for k, v in defaults.items()}
        changed = _other(hints[f.name], defaults[f.name], f.name)
        assert changed != defaults[f.name]
        obj = cls(**{**base, f.name: changed})
        line = json.dumps(to_wire(obj))  # what really travels: one JSON line
        back = from_wire(cls, json.loads(line))
        assert getattr(back, f.name) == changed, f"{cls.__name__}.{f.name} was lost"
        assert back == obj
    # and the defaults, None for every optional field included, come back as they went
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    obj = cls(**{k: (_other(hints[k], None, k) if k in required else v)
                 for k, v in defaults.items()})
    assert from_wire(cls, json.loads(json.dumps(to_wire(obj)))) == obj


def test_unknown_field_is_a_protocol_error() -> None:
    doc = to_wire(CreateOptions(fetch="lazy"))
    doc["gpus"] = 4
    with pytest.raises(ProtocolError, match=r"CreateOptions: unknown field\(s\) 'gpus'") as e:
        from_wire(CreateOptions, doc)
    assert e.value.exit_code == 2


def test_wrong_type_and_missing_fields() -> None:
    with pytest.raises(ProtocolError, match=r"CreateOptions\.cpus"):
        from_wire(CreateOptions, {"cpus": "two"})
    with pytest.raises(ProtocolError, match=r"CreateOptions\.network"):
        from_wire(CreateOptions, {"network": "bridge"})
    with pytest.raises(ProtocolError, match=r"required field 'exit_code'"):
        from_wire(ExecResult, {"stdout": "", "stderr": "", "duration": 0})
    # an older sender that lacks a field: the field takes its default
    assert from_wire(CreateOptions, {"backend": "fncall"}) == CreateOptions(backend="fncall")


def test_fetch_lazy_on_a_remote_node_runs_lazy(client: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    sid = run_dsec("run", "--node", "node1", "-d", "--backend", "fncall", "--fetch", "lazy",
                   IMAGE).stdout.strip()
    try:
        assert sid.startswith("node1/")
        assert int(run_dsec("exec", sid, "--", "wc", "-c", "/bin/busybox").stdout.split()[0]) > 0
        doc = json.loads(run_dsec("inspect", sid, "--json").stdout)
        assert doc.get("fetch", {}).get("mode") == "lazy", doc
    finally:
        run_dsec("rm", sid)
