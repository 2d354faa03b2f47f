"""The node contract: the local `Node` and the cluster's `RemoteNode` both offer every
operation of `NodeAPI` with compatible parameters, so code holding a `NodeAPI` (the public
API's routing) works with either."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from dsec_cli.run.cluster.remote import RemoteNode
from dsec_cli.run.contract import NodeAPI
from dsec_cli.run.node import Node

OPERATIONS = sorted(n for n, v in vars(NodeAPI).items()
                    if callable(v) and not n.startswith("_"))


def incompatibilities(proto: Any, impl: Any) -> list[str]:
    """How ``impl``'s signature fails to accept every call ``proto``'s accepts: each
    contract parameter present with the same name, kind and default; extra parameters
    only with defaults."""
    want = inspect.signature(proto).parameters
    have = inspect.signature(impl).parameters
    out = []
    for name, p in want.items():
        q = have.get(name)
        if q is None:
            out.append(f"missing parameter {name!r}")
        elif q.kind != p.kind:
            out.append(f"{name!r} is {q.kind.description}, the contract has "
                       f"{p.kind.description}")
        elif q.default != p.default:
            out.append(f"{name!r} defaults to {q.default!r}, the contract to {p.default!r}")
    positional = [n for n, p in want.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    have_positional = [n for n, p in have.items()
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if have_positional[:len(positional)] != positional:
        out.append(f"positional order {have_positional} differs from {positional}")
    for name, q in have.items():
        if name not in want and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL,
                                                                          q.VAR_KEYWORD):
            out.append(f"extra parameter {name!r} has no default")
    return out


def test_the_contract_lists_the_operations_the_api_uses() -> None:
    assert {"create", "lookup", "sandboxes", "exec", "put_file", "get_file", "snapshot",
            "pause", "resume", "remove", "describe", "info", "gc",
            "fetch_stats"} <= set(OPERATIONS)


@pytest.mark.parametrize("cls", [Node, RemoteNode], ids=lambda c: c.__name__)
@pytest.mark.parametrize("op", OPERATIONS)
def test_node_implements_the_contract(cls: type, op: str) -> None:
    impl = getattr(cls, op, None)
    assert impl is not None and callable(impl), f"{cls.__name__} lacks {op}()"
    assert incompatibilities(getattr(NodeAPI, op), impl) == [], f"{cls.__name__}.{op}"


def test_the_check_catches_drift() -> None:
    """The comparison itself fails on the kinds of drift it exists for."""
    def contract(self: Any, sid: str, *, timeout: float | None = None) -> None: ...
    def renamed(self: Any, sandbox: str, *, timeout: float | None = None) -> None: ...
    def positional(self: Any, sid: str, timeout: float | None = None) -> None: ...
    def new_default(self: Any, sid: str, *, timeout: float | None = 5.0) -> None: ...
    def required_extra(self: Any, sid: str, force: bool, *,
                       timeout: float | None = None) -> None: ...
    def fine_extra(self: Any, sid: str, *, timeout: float | None = None,
                   reconcile: bool = True) -> None: ...

    for bad in (renamed, positional, new_default, required_extra):
        assert incompatibilities(contract, bad), bad.__name__
    assert incompatibilities(contract, fine_extra) == []
