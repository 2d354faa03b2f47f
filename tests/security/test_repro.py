"""Hostile or mismatched input at the boundaries this area owns: agent payloads that do not
fit their dataclass are refused with a clear protocol error (never a crash, never a
half-filled object), and a ref a store holds cannot be moved by a push without --replace."""

from __future__ import annotations

import hashlib

import pytest

from dsec_cli.backends.base import ExecResult
from dsec_cli.core.digests import object_key
from dsec_cli.core.errors import RefConflictError
from dsec_cli.push.transfer import copy_refs
from dsec_cli.run.cluster.errors import ProtocolError
from dsec_cli.run.cluster.protocol import from_wire
from dsec_cli.run.node import CreateOptions
from dsec_cli.run.state import SandboxRecord

from ..push.helpers import raw_layer


@pytest.mark.parametrize(("cls", "doc", "field"), [
    (CreateOptions, ["not", "an", "object"], "expected an object"),
    (CreateOptions, {"memory": True}, "CreateOptions.memory"),  # a bool is not an int
    (CreateOptions, {"env": {"A": 1}}, "CreateOptions.env"),
    (CreateOptions, {"env": ["A=1"]}, "CreateOptions.env"),
    (CreateOptions, {"__class__": "x"}, "unknown field"),
    (ExecResult, {"exit_code": 0, "stdout": "@@not base64@@", "stderr": "",
                  "duration": 0.1}, "ExecResult.stdout"),
    (ExecResult, {"exit_code": "0", "stdout": "", "stderr": "", "duration": 0}, "exit_code"),
    (SandboxRecord, {"id": "x"}, "required field"),
    (SandboxRecord, {"id": "x", "backend": "fncall", "image": "i", "image_digest": "d",
                     "status": "running", "handle": None, "spec": {}, "created": 1.0,
                     "expires": None, "layers": "abc"}, "SandboxRecord.layers"),
])
def test_payloads_that_do_not_fit_are_refused(cls: type, doc: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=field) as e:
        from_wire(cls, doc)
    assert e.value.exit_code == 2


def test_push_cannot_move_a_ref_in_a_shared_store(tmp_path: object) -> None:
    from dsec_cli.format.refs import get_ref
    from dsec_cli.push.stores import open_store

    a = open_store(str(tmp_path / "a"))  # type: ignore[operator]
    shared = open_store(str(tmp_path / "shared"))  # type: ignore[operator]
    mine = raw_layer(shared, "lib", "1", [b"the owner's pack"])
    other = raw_layer(a, "lib", "1", [b"someone else's pack"])
    with pytest.raises(RefConflictError) as e:
        copy_refs(a, shared, ["lib@1"])
    assert mine in e.value.message and other in e.value.message
    assert get_ref(shared, "lib@1").manifest == mine
    # refused before anything was copied: neither the other manifest nor its pack
    pack = hashlib.sha256(b"someone else's pack").hexdigest()
    assert shared.has(object_key("manifests", mine))
    assert not shared.has(object_key("manifests", other))
    assert not shared.has(object_key("packs", pack))
