"""Moving a parked sandbox between nodes (run/migrate.py), the refusals: what cannot move is
refused with exit code 2 and a message naming why, and a malformed import leaves the node
unchanged (no row, no sandbox dir, no incoming files)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec_cli.core.errors import UsageError
from dsec_cli.run.node import CreateOptions, Node
from tests.run.conftest import IMAGE, dsec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.fixture
def parked_container(node: Node) -> Iterator[str]:
    rec = node.create(IMAGE, CreateOptions(backend="container"))
    try:
        node.park(rec.id)
        yield rec.id
    finally:
        node.remove(rec.id)


def test_a_container_does_not_move(node: Node, parked_container: str,
                                   node_env: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="only microvm and vm"):
        node.park_export(parked_container)
    p = dsec(node_env, "thaw", parked_container, "--to", "nowhere", check=2)
    assert b"nowhere" in p.stderr  # the unknown target is named, nothing moved
    assert node.lookup(parked_container).status == "parked"


def test_bad_imports_leave_the_node_unchanged(node: Node) -> None:
    before = {r.id for r in node.db.all()}
    sid = "abcdef012345"
    with pytest.raises(UsageError, match="invalid sandbox id"):
        node.park_incoming("../x")
    into = node.park_incoming(sid)
    good = {"record": {"id": sid, "backend": "microvm", "image": IMAGE,
                       "image_digest": "0" * 64, "spec": {}, "created": 1.0, "expires": None},
            "handle": {"state_dir": "/x", "root_image": "/y/r.erofs"}, "root_name": "r.erofs"}
    bad = [
        ({**good, "record": {**good["record"], "id": "../../etc"}}, "invalid sandbox id"),
        ({**good, "record": {**good["record"], "backend": "container"}}, "cannot import"),
        ({**good, "root_name": "../../r.erofs"}, "invalid root image name"),
        ({**good, "record": {**good["record"], "spec": "x"}}, "malformed"),
        (good, "lacks park.state"),  # nothing was copied into the incoming dir
    ]
    for doc, msg in bad:
        with pytest.raises(UsageError, match=msg):
            node.park_import(doc)
    # an existing id is never overwritten
    other = node.create(IMAGE, CreateOptions(backend="container"))
    try:
        with pytest.raises(UsageError, match="already has a sandbox"):
            node.park_incoming(other.id)
    finally:
        node.remove(other.id)
    assert {r.id for r in node.db.all()} == before
    assert not (node.sandboxes_dir / sid).exists()
    os.rmdir(into)
