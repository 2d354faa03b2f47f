"""The node protocol's promises (docs/cluster.md): a node service refuses a client of another
protocol version, and a client refuses a node that speaks another one; a create whose reply
was lost is never sent again (it is not idempotent: the node may have made the sandbox)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IMAGE
from .sshnodes import SshCluster

#: a node service stand-in, run over the node's real sshd: it logs every request it gets, and
#: answers hello as a node of the given protocol version
FAKE_NODE = """#!{python}
import json, sys
log = open({log!r}, "a")
version, mode = {version!r}, {mode!r}
for line in sys.stdin:
    msg = json.loads(line)
    log.write(msg["op"] + "\\n")
    log.flush()
    if msg["op"] == "hello":
        if msg["args"].get("version") != version:  # what a node service of that version says
            err = {{"type": "UsageError", "message": "client speaks node protocol "
                    + str(msg["args"].get("version")) + ", this node speaks " + str(version),
                    "hint": "install the same dsec on both sides", "exit_code": 2}}
            reply = {{"id": msg["id"], "ok": False, "error": err}}
        else:
            reply = {{"id": msg["id"], "ok": True, "result": {{"protocol": version}}}}
    elif msg["op"] == "create" and mode == "lose-create":
        sys.exit(0)  # the node took the request; its reply is lost with the connection
    else:
        reply = {{"id": msg["id"], "ok": True, "result": {{}}}}
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""


def _fake_node(client: SshCluster, tmp_path: Path, version: int, mode: str) -> Path:
    """Adds node `fake` to this test's user config: node1's sshd, the stand-in as its dsec;
    returns the stand-in's request log."""
    from dsec_cli.core.config import save_user_config

    log = tmp_path / "requests.log"
    log.touch()
    script = tmp_path / "fake-node"
    script.write_text(FAKE_NODE.format(python=sys.executable, log=str(log), version=version,
                                       mode=mode))
    script.chmod(0o755)
    tmp_path.chmod(0o755)
    nodes = client.config_nodes()
    nodes["fake"] = {**nodes["node1"], "dsec": str(script)}
    save_user_config({"nodes": nodes})
    return log


def test_node_service_refuses_a_client_of_another_version(tmp_path: Path) -> None:
    """The real node service: hello with protocol 1 is refused, naming both versions, and no
    other request is served on that stream."""
    from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION

    dsec = str(Path(sys.executable).with_name("dsec"))
    reqs = [{"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION - 1}},
            {"id": 2, "op": "info", "args": {}}]
    p = subprocess.run([dsec, "agent", "--stdio"], input="".join(json.dumps(r) + "\n"
                                                                for r in reqs),
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "DSEC_STATE_DIR": str(tmp_path / "state")})
    replies = {m["id"]: m for m in map(json.loads, p.stdout.splitlines())}
    hello, info = replies[1], replies[2]
    assert not hello["ok"] and f"protocol {PROTOCOL_VERSION - 1}" in hello["error"]["message"]
    assert str(PROTOCOL_VERSION) in hello["error"]["message"]
    assert not info["ok"] and "first request must be hello" in info["error"]["message"]


def test_client_refuses_a_node_of_another_version(client: SshCluster, tmp_path: Path,
                                                  run_dsec) -> None:  # type: ignore[no-untyped-def]
    from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION

    log = _fake_node(client, tmp_path, PROTOCOL_VERSION + 1, "answer")
    # the stand-in speaks the session protocol: no resident service
    p = run_dsec("run", "--node", "fake", "-d", IMAGE, check=2,
                 env={**client.client_env(), "DSEC_NODE_AGENT": "stdio"})
    assert "fake" in p.stderr and f"protocol {PROTOCOL_VERSION}" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert "create" not in log.read_text().split()  # refused at the greeting


def test_create_is_never_sent_again_after_a_lost_reply(client: SshCluster, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_cli.core.errors import DsecError
    from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION
    from dsec_cli.run.cluster.registry import get_node

    log = _fake_node(client, tmp_path, PROTOCOL_VERSION, "lose-create")
    monkeypatch.setenv("DSEC_NODE_AGENT", "stdio")  # the stand-in speaks the session protocol
    node = get_node("fake")
    with pytest.raises(DsecError):
        node.create(IMAGE)
    ops = log.read_text().split()
    assert ops.count("create") == 1, ops  # the node may have made it: never a second one
    node.info()  # the next request opens a fresh connection, greeting again
    assert log.read_text().split() == ["hello", "create", "hello", "info"]


def test_attempts_resend_only_read_only_requests_and_stay_within_the_budget() -> None:
    from dsec_cli.run.cluster.remote import RETRIES, Attempts
    clock = [0.0]
    create = Attempts("create", budget=100.0, now=lambda: clock[0])
    assert create.retry(sent=False) == 0.2       # not sent: a create may be tried again
    assert create.retry(sent=True) is None       # sent, reply lost: never again
    ps = Attempts("ps", budget=100.0, now=lambda: clock[0])
    waits = [ps.retry(sent=True) for _ in range(RETRIES)]
    assert waits[:RETRIES - 1] == [0.2 * 2 ** i for i in range(RETRIES - 1)]
    assert waits[-1] is None                     # RETRIES attempts in all
    silent = Attempts("ps", budget=10.0, now=lambda: clock[0])
    clock[0] = 6.0                               # the first attempt took 6 s of a 10 s budget
    assert silent.retry(sent=False) is None      # a second one would end past it
