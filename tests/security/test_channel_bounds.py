"""What a sandbox's agent channel and a cluster node send is bounded, and an exec's timeout
is a deadline the host keeps on its own clock.

The hostile agent is a process in the sandbox's own cgroup (so the host's peer check takes
it for the sandbox's agent) listening where the host reaches the agent; it sends a frame
header claiming 4 GiB and then as much as the host reads. The frozen agent is the real one,
SIGSTOPped from the host while a command runs. The hostile node is a real sshd on loopback
whose dsec is a program printing a 600 MiB line. Each client runs in its own process, whose
peak RSS is measured (`_sandboxes.run_measured`). Everything a probe writes is under the
test's tmp_path or in its own sandbox."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.backends import _cgroups
from dsec_cli.run.node import CreateOptions, Node
from tests.cluster.sshnodes import SshCluster, make_cluster
from tests.run.conftest import IMAGE

from ._sandboxes import *  # noqa: F403 - the sandbox fixtures
from ._sandboxes import Ran, run_measured
from .test_agent_channel import _agent_socket

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes and sshd need root")

MiB = 1 << 20
#: what a bounded client may reach at its peak (its imports, one frame or line, a read)
PEAK = 200 * MiB
DSEC = str(Path(sys.executable).with_name("dsec"))

#: a stand-in agent: listens at argv[1], sends one header claiming 4 GiB and then zeros (at
#: most argv[2] bytes) for as long as the host reads; writes how much it sent to argv[3]
FAKE_AGENT = """
import socket, struct, sys
path, most, report = sys.argv[1], int(sys.argv[2]), sys.argv[3]
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(1)
print("ready", flush=True)
sys.stdin.readline()  # the test moved this process into the sandbox's cgroup
srv.settimeout(60)
conn, _ = srv.accept()
conn.settimeout(60)
sent = 0
try:
    conn.sendall(struct.pack(">IBI", 0xFFFFFFFF, 16, 1))
    block = bytes(1 << 20)
    while sent < most:
        conn.sendall(block)
        sent += len(block)
except OSError:
    pass
open(report, "w").write(str(sent))
"""

#: async SDK drivers of one exec, run as their own process: exit 1 with the error's class and
#: message on stderr, else the result as JSON
ASYNC_EXEC = """
import asyncio, json, os, sys
from dsec_cli.core.errors import DsecError
from dsec_cli.run.aio import AsyncNode
from dsec_cli.run.node import Node

async def main():
    node = AsyncNode(Node(os.environ["DSEC_STATE_DIR"], os.environ["DSEC_STORE"]))
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
    return await node.exec(sys.argv[1], sys.argv[3:] or ["true"], timeout=timeout)

try:
    r = asyncio.run(main())
except DsecError as e:
    sys.exit(f"{type(e).__name__}: {e}")
print(json.dumps({"exit_code": r.exit_code, "timed_out": r.timed_out}))
"""

ASYNC_NODE_EXEC = """
import asyncio, sys
from dsec_cli.run.cluster.aio import AsyncRemoteNode, close_channels
from dsec_cli.run.cluster.remote import NodeEntry
from dsec_cli.run.cluster.ssh import Address, SshTarget

port, identity, known, fake = sys.argv[1:5]
entry = NodeEntry("fake", SshTarget(Address("root", "127.0.0.1", int(port)), identity, known),
                  dsec=fake)

async def main():
    try:
        await AsyncRemoteNode(entry).exec("fake/abc123", ["true"])
    finally:
        await close_channels()

try:
    asyncio.run(main())
except Exception as e:
    sys.exit(f"{type(e).__name__}: {e}")
"""


@pytest.fixture
def box(node: Node) -> Iterator[str]:
    """A container sandbox of its own (the tests below may leave its agent dead)."""
    sid = node.create(IMAGE, CreateOptions(backend="container")).id
    try:
        yield sid
    finally:
        pid = node.handle_of(node.lookup(sid)).state.get("pid")
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)  # a test that failed may leave it stopped
            except ProcessLookupError:
                pass
        node.remove(sid)


def _cgroup(node: Node, sid: str) -> _cgroups.Cgroup:
    return _cgroups.Cgroup(node.handle_of(node.lookup(sid)).state["cgroup"])


def _bounded_failure(ran: Ran, *names: str) -> None:
    """The client returned by itself, with exit 1 and a message naming `names`, at a small
    peak RSS."""
    text = " ".join(ran.stderr.decode(errors="replace").split())  # rich wraps long lines
    assert not ran.timed_out, f"did not return within the bound: {text[-2000:]}"
    assert ran.returncode == 1, (ran.returncode, text[-2000:])
    assert "Traceback" not in text, text[-4000:]
    for name in names:
        assert name in text, text[-2000:]
    assert ran.max_rss < PEAK, f"peak RSS {ran.max_rss / MiB:.0f} MiB"


# -- a frame past the bound ---------------------------------------------------------------
@pytest.mark.parametrize("client", ["cli", "async"])
def test_huge_agent_frame_is_refused_from_its_header(client: str, box: str, node: Node,
                                                     node_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    sock, report = _agent_socket(node, box), tmp_path / "sent"
    os.unlink(sock)  # the real agent keeps its listener; only the host's way to it moves
    fake = subprocess.Popen([sys.executable, "-c", FAKE_AGENT, sock, str(320 * MiB),
                             str(report)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert fake.stdout is not None and fake.stdin is not None
        assert fake.stdout.readline() == b"ready\n"
        _cgroup(node, box).add(fake.pid)  # in the sandbox, as far as the host can tell
        fake.stdin.write(b"go\n")
        fake.stdin.flush()
        if client == "cli":
            ran = run_measured([DSEC, "exec", box, "--", "true"], node_env, timeout=60)
        else:
            ran = run_measured([sys.executable, "-c", ASYNC_EXEC, box], node_env, timeout=60)
        fake.wait(60)
    finally:
        fake.kill()
        fake.wait()
    _bounded_failure(ran, f"sandbox {box}", "4294967295")
    assert int(report.read_text()) < 64 * MiB  # the host dropped the connection


# -- a frozen agent -------------------------------------------------------------------------
def _sleepers(cg: _cgroups.Cgroup, marker: bytes) -> list[int]:
    out = []
    for pid in cg.procs():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", marker]:
                    out.append(pid)
        except OSError:
            continue
    return out


@pytest.mark.parametrize("client", ["cli", "async"])
def test_exec_timeout_holds_against_a_frozen_agent(client: str, box: str, node: Node,
                                                   node_env: dict[str, str]) -> None:
    cg, agent = _cgroup(node, box), node.handle_of(node.lookup(box)).state["pid"]
    marker = b"4321"
    if client == "cli":
        argv = [DSEC, "exec", "--timeout", "2", box, "--", "sleep", marker.decode()]
    else:
        argv = [sys.executable, "-c", ASYNC_EXEC, box, "2", "sleep", marker.decode()]
    proc = subprocess.Popen(argv, env={**os.environ, **node_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not _sleepers(cg, marker):
            assert proc.poll() is None and time.monotonic() < deadline, "it never ran"
            time.sleep(0.02)
        os.kill(agent, signal.SIGSTOP)
        out, err = proc.communicate(timeout=60)  # "does not hang"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.decode(errors="replace")
    assert "Traceback" not in text, text
    if client == "cli":
        assert proc.returncode == 137 and "timed out" in text, (proc.returncode, text)
    else:
        assert proc.returncode == 0, text
        assert json.loads(out) == {"exit_code": 137, "timed_out": True}
    deadline = time.monotonic() + 30
    while _sleepers(cg, marker):
        assert time.monotonic() < deadline, "the command outlived its timeout"
        time.sleep(0.05)


# -- a node's line past the bound -------------------------------------------------------------
#: a node whose dsec answers every command with a 600 MiB line; counts its runs
FAKE_NODE = """#!/bin/sh
echo run >> {count}
head -c {size} /dev/zero | tr '\\0' x
echo
"""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    """One real sshd on loopback (tests/cluster/sshnodes.py); its dsec is given per test."""
    root = tmp_path_factory.mktemp("sshd")
    data = root / "data"
    data.mkdir()
    c = make_cluster(root / "nodes", (root / "nostore").as_uri(), data, 1)
    try:
        yield c
    finally:
        from dsec_cli.run.cluster.remote import close_all

        close_all()
        c.close_masters()
        for n in c.nodes:
            n.stop()
            shutil.rmtree(n.agent_dir, ignore_errors=True)
        shutil.rmtree(c.control_dir, ignore_errors=True)


def _fake_node(sshd: SshCluster, tmp_path: Path) -> tuple[Path, Path]:
    count = tmp_path / "runs"
    script = tmp_path / "fake-dsec"
    script.write_text(FAKE_NODE.format(count=count, size=600 * MiB))
    script.chmod(0o755)
    tmp_path.chmod(0o755)
    return script, count


@pytest.mark.parametrize("mode", ["resident", "stdio", "async"])
def test_huge_node_line_is_refused(mode: str, sshd: SshCluster, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_cli.core.config import save_user_config

    script, count = _fake_node(sshd, tmp_path)
    node = sshd.nodes[0]
    env = {**sshd.client_env(), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "DSEC_NODE_AGENT": "stdio" if mode == "stdio" else "resident"}
    if mode == "async":
        ran = run_measured([sys.executable, "-c", ASYNC_NODE_EXEC, str(node.port),
                            str(sshd.identity), str(sshd.known_hosts), str(script)], env,
                           timeout=60)
    else:
        monkeypatch.setenv("XDG_CONFIG_HOME", env["XDG_CONFIG_HOME"])
        nodes = sshd.config_nodes()
        save_user_config({"nodes": {"fake": {**nodes[node.name], "dsec": str(script)}}})
        ran = run_measured([DSEC, "exec", "fake/abc123", "--", "true"], env, timeout=60)
    _bounded_failure(ran, "fake", "message of more than")
    assert "NodeUnreachableError" not in ran.stderr.decode(errors="replace")
    assert count.read_text().split() == ["run"]  # refused, not retried
