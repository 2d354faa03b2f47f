"""Forks on real runc and bubblewrap: every copy starts from the parent's files, and a write
in one copy is seen neither by the other copies nor by the parent."""

from __future__ import annotations

import json

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import UsageError
from tests.run.conftest import dsec

from .conftest import IMAGE, leaks


def _isolated(parent: Sandbox, copies: list[Sandbox], prefix_path: str) -> None:
    """Each copy sees the prefix; its own write is its alone."""
    for c in copies:
        assert c.read_file(prefix_path) == b"prefix"
    for i, c in enumerate(copies):
        c.write_file(prefix_path, f"copy {i}")
        assert c.exec(f"echo more-{i} > {prefix_path}.{i}").exit_code == 0
    for i, c in enumerate(copies):
        assert c.read_file(prefix_path) == f"copy {i}".encode()
        others = c.exec(f"ls {prefix_path}.*").stdout.split()
        assert others == [f"{prefix_path}.{i}".encode()]
    assert parent.read_file(prefix_path) == b"prefix"
    assert parent.exec(f"ls {prefix_path}.* 2>/dev/null").stdout == b""


def test_container_fork_shares_one_layer(node_env: dict[str, str]) -> None:
    with Sandbox.create(IMAGE) as parent:
        parent.write_file("/root/state", "prefix")
        parent.exec("mkdir -p /root/dir && echo deep > /root/dir/f && rm /bin/true")
        copies = parent.fork(3)
        try:
            assert len({c.id for c in copies} | {parent.id}) == 4
            layers = [c.node.lookup(c.id).layers for c in copies]
            assert layers[0] == layers[1] == layers[2]  # one snapshot layer, shared
            assert len(layers[0]) == len(parent.node.lookup(parent.id).layers) + 1
            for c in copies:
                assert c.read_file("/root/dir/f") == b"deep\n"
                assert c.exec("test -e /bin/true").exit_code == 1  # the deletion too
            _isolated(parent, copies, "/root/state")
        finally:
            for c in copies:
                c.remove()
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_fncall_fork_copies_tmp(node_env: dict[str, str]) -> None:
    with Sandbox.create(IMAGE, "fncall") as parent:
        parent.write_file("/tmp/state", "prefix")
        parent.exec("mkdir -p /tmp/d/e && echo deep > /tmp/d/e/f && ln -s d/e/f /tmp/link"
                    " && chmod 700 /tmp/d")
        copies = parent.fork(2)
        try:
            for c in copies:
                assert c.backend == "fncall"
                assert c.exec("cat /tmp/link; stat -c %a /tmp/d").stdout == b"deep\n700\n"
            _isolated(parent, copies, "/tmp/state")
        finally:
            for c in copies:
                c.remove()
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_fork_refusals(node_env: dict[str, str]) -> None:
    with Sandbox.create(IMAGE) as parent:
        before = {r.id for r in parent.node.sandboxes()}
        for bad in (0, -1, 257, True):
            with pytest.raises(UsageError, match="fork count"):
                parent.fork(bad)  # type: ignore[arg-type]
        assert {r.id for r in parent.node.sandboxes()} == before  # nothing made
    p = dsec(node_env, "fork", "nosuch", "-n", "2", check=2)
    assert b"no sandbox" in p.stderr


def test_cli_fork(node_env: dict[str, str]) -> None:
    with Sandbox.create(IMAGE) as parent:
        parent.write_file("/root/x", "prefix")
        out = json.loads(dsec(node_env, "fork", parent.id, "-n", "2", "--json").stdout)
        ids = [c["id"] for c in out["copies"]]
        try:
            assert len(ids) == 2 and out["shared"] == "layer"
            for sid in ids:
                assert dsec(node_env, "exec", sid, "--", "cat", "/root/x").stdout == b"prefix"
        finally:
            dsec(node_env, "rm", *ids)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_fork_refuses_what_it_cannot_copy(node_env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.backends.layers import busybox_layer

    rootfs = busybox_layer(tmp_path / "rootfs")
    with Sandbox.create(rootfs) as parent:  # a directory image: no store layer to stack on
        before = {r.id for r in parent.node.sandboxes()}
        with pytest.raises(UsageError, match="directory image"):
            parent.fork(1)
        assert {r.id for r in parent.node.sandboxes()} == before
    with Sandbox.create(IMAGE, "fncall") as parent:
        parent.pause()
        with pytest.raises(UsageError, match="paused"):
            parent.fork(1)
        parent.resume()
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_fncall_tmp_reader_refuses_hostile_records() -> None:
    """What an fncall parent sends about its /tmp is checked before it is held."""
    from dsec_cli.core.errors import SandboxError
    from dsec_cli.run.fork import MAX_TMP_BYTES, _TmpTree

    for rel in (b"../x", b"a/../../x", b"a//b", b"./a", b"a\0b"):
        with pytest.raises(SandboxError, match="bad name"):
            _TmpTree().entry("f", 0o644, 1, rel, b"")
    t = _TmpTree()
    t.entry("f", 0o644, 4, b"f", b"")
    with pytest.raises(SandboxError, match="past a file's size"):
        t.chunk(2, memoryview(b"xyz"))
    with pytest.raises(UsageError, match="too much"):
        t.entry("f", 0o644, MAX_TMP_BYTES, b"g", b"")
    t.chunk(0, memoryview(b"abcd"))
    assert t.files == [("/tmp/f", 0o644, bytearray(b"abcd"))]
