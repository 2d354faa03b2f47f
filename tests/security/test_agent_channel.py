"""The host's channel to a sandbox's agent cannot be redirected from inside a sandbox.

Code in sandbox A runs as root over A's files. It knows where other sandboxes' agents listen
(paths are predictable), and it tries to make `dsec exec A` and `dsec cp A:...` reach
sandbox B instead: by replacing the agent socket it can see with a symlink to B's. Each
sandbox writes its own name to /marker; whatever dsec does to A must read A's marker or be
refused. The probes write only inside sandbox A's own files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.backends.sandbox_agent.client import AgentError
from dsec_cli.run.node import CreateOptions, Node
from tests.run.conftest import IMAGE, dsec

from ._sandboxes import *  # noqa: F403 - the sandbox fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def _agent_socket(node: Node, sid: str) -> str:
    """Where the host reaches this sandbox's agent (whatever the layout of the day)."""
    st = node.handle_of(node.lookup(sid)).state
    return st.get("agent_sock") or str(Path(st["run_dir"]) / "agent.sock")


@pytest.fixture(scope="module", params=["container", "fncall"])
def pair(request: pytest.FixtureRequest, node: Node) -> Iterator[tuple[str, str]]:
    """Two sandboxes of one backend, each with its name in a marker file (in /tmp for
    fncall, whose root is read-only)."""
    ids = [node.create(IMAGE, CreateOptions(backend=request.param)).id for _ in range(2)]
    try:
        for sid, name in zip(ids, ("A", "B"), strict=True):
            where = "/tmp/marker" if request.param == "fncall" else "/marker"
            r = node.exec(sid, ["sh", "-c", f"echo sandbox-{name} > {where}"])
            assert r.exit_code == 0, r.stderr
        yield ids[0], ids[1]
    finally:
        for sid in ids:
            node.remove(sid)


def _marker(backend_is_fncall: bool) -> str:
    return "/tmp/marker" if backend_is_fncall else "/marker"


def test_symlinked_socket_does_not_redirect_exec_or_cp(pair: tuple[str, str], node: Node,
                                                       node_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    a, b = pair
    fncall = node.lookup(a).backend == "fncall"
    b_sock = _agent_socket(node, b)
    # from inside A: every agent-socket path A can see now points at B's socket (fncall's
    # root is read-only: there the attempt itself fails, which is as good)
    r = node.exec(a, ["sh", "-c", f"mkdir -p /.dsec/run && rm -f /.dsec/run/agent.sock && "
                                  f"ln -s {b_sock} /.dsec/run/agent.sock"])
    assert r.exit_code == 0 or fncall, r.stderr
    node.backend(node.lookup(a).backend)._drop_client(a)  # the next call connects afresh

    p = dsec(node_env, "exec", a, "--", "cat", _marker(fncall), check=None)
    assert b"sandbox-B" not in p.stdout
    assert p.stdout == b"sandbox-A\n" or (p.returncode != 0 and b"refusing" in p.stderr)
    p = dsec(node_env, "cp", f"{a}:{_marker(fncall)}", str(tmp_path / "m"), check=None)
    got = (tmp_path / "m").read_bytes() if (tmp_path / "m").exists() else b""
    assert b"sandbox-B" not in got
    assert got == b"sandbox-A\n" or (p.returncode != 0 and b"refusing" in p.stderr)


def test_socket_served_by_another_sandbox_is_refused(pair: tuple[str, str], node: Node,
                                                     tmp_path: Path) -> None:
    """Whatever path the host is given (a sandbox's state from an older layout, which kept
    the socket in a directory the sandbox could write), it talks only to a listener in the
    sandbox's own cgroup: B's socket presented as A's is refused by SO_PEERCRED."""
    a, b = pair
    rec = node.lookup(a)
    backend = node.backend(rec.backend)
    handle = node.handle_of(rec)
    evil = tmp_path / "run"
    evil.mkdir()
    (evil / "agent.sock").symlink_to(_agent_socket(node, b))
    handle.state = {k: v for k, v in handle.state.items() if k != "agent_sock"}
    handle.state["run_dir"] = str(evil)
    with pytest.raises(AgentError, match="refusing the agent socket"):
        client = backend._connect(handle)
        try:  # reached only where nothing checks the peer: show whom it reached
            print("reached:", client.exec(["cat", _marker(rec.backend == "fncall")]).stdout)
        finally:
            client.close()
