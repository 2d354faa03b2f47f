"""The resident node service: one long-lived service per node, reused by every call of every
client process, restarted cleanly when killed, refusing another protocol version, and gone
(with its socket and pid file) once idle."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dsec_cli.core.errors import NodeUnreachableError
from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION, decode, encode

from .conftest import IMAGE
from .sshnodes import SshCluster


def _service_pid(name: str = "node1") -> int:
    """The pid of the node service a fresh connection of this process reaches."""
    from dsec_cli.run.cluster.registry import get_node
    from dsec_cli.run.cluster.remote import channel, close_all

    close_all()  # a new connection, as a new client process would open
    return int(channel(get_node(name).entry, 30).hello["pid"])


def _socket_of(pid: int) -> str:
    """The socket a resident service serves (its command line names it)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    return next(a.decode() for a in args if a.endswith(b".sock"))


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def test_calls_from_every_client_reuse_one_service(client: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    node = client.nodes[0]
    first = _service_pid()
    assert _service_pid() == first
    for _ in range(3):  # other client processes, through the CLI
        out = json.loads(run_dsec("ps", "--node", "node1", "--json").stdout)
        assert isinstance(out, list)
    assert _service_pid() == first
    sock = _socket_of(first)
    assert node.agent_processes(sock) == {first}  # one service for this environment
    # the forward's local end removed under the master (a /tmp cleaner): set up anew
    for end in client.control_dir.glob("*.s"):
        end.unlink()
    assert _service_pid() == first


def test_killed_service_is_restarted_and_sandboxes_survive(client: SshCluster, run_dsec  # type: ignore[no-untyped-def]
                                                            ) -> None:
    from dsec_cli.run.cluster.registry import get_node
    from dsec_cli.run.cluster.remote import close_all

    node = client.nodes[0]
    sid = run_dsec("run", "--node", "node1", "-b", "fncall", "-d", IMAGE).stdout.strip()
    try:
        old = _service_pid()
        sock = _socket_of(old)
        remote = get_node("node1")
        failed: list[BaseException] = []

        def long_exec() -> None:
            try:
                remote.exec(sid, ["sh", "-c", f"sleep 20; : {token}"])
            except BaseException as e:  # noqa: BLE001 - recorded and asserted below
                failed.append(e)

        token = f"mid-exec-{os.getpid()}-{time.monotonic_ns()}"
        t = threading.Thread(target=long_exec)
        t.start()
        deadline = time.monotonic() + 30  # kill it mid-request: once the exec runs
        while time.monotonic() < deadline and not _runs(token):
            time.sleep(0.05)
        os.kill(old, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
        assert failed and isinstance(failed[0], NodeUnreachableError), failed
        _wait_gone(old)
        # the next call restarts it: same sandbox, answering, one service process
        assert run_dsec("exec", sid, "--", "echo", "ok").stdout == "ok\n"
        new = _service_pid()
        assert new != old
        assert node.agent_processes(sock) == {new}
        # killed again between calls, a CLI call restarts it as well
        os.kill(new, signal.SIGKILL)
        _wait_gone(new)
        close_all()
        out = json.loads(run_dsec("ps", "--node", "node1", "--json").stdout)
        assert sid in {r["id"] for r in out}
        left = node.agent_processes(sock)
        assert len(left) == 1 and new not in left
        # and no SSH session stays behind on the node (starters and sessions all ended)
        deadline = time.monotonic() + 30
        while _agent_sessions(node) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _agent_sessions(node) == []
    finally:
        run_dsec("rm", sid)


def _agent_sessions(node) -> list[str]:  # type: ignore[no-untyped-def]
    """`dsec agent` commands running under the node's sshd (a session per command)."""
    from .sshnodes import descendants

    out = []
    for pid in descendants(node.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if " agent " in cmd or cmd.endswith(" agent"):
            out.append(cmd)
    return out


def _runs(token: str) -> bool:
    """A process whose command line holds ``token`` runs (the exec reached the sandbox)."""
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        return True
            except OSError:
                continue
    return False


def test_service_refuses_another_protocol_version(client: SshCluster) -> None:
    node = client.nodes[0]
    pid = _service_pid()
    sock = _socket_of(pid)
    assert sock.startswith(str(node.agent_dir))

    def hello(version: object) -> dict[str, object]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(sock))
            s.sendall(encode({"id": 1, "op": "hello", "args": {"version": version}}))
            with s.makefile("rb") as r:
                return decode(r.readline())

    refused = hello(PROTOCOL_VERSION + 1)
    assert refused["ok"] is False
    assert "speaks node protocol" in str(refused["error"])
    answered = hello(PROTOCOL_VERSION)
    assert answered["ok"] is True and answered["result"]["pid"] == pid  # type: ignore[index]


def test_stdio_sessions_still_serve(client: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    out = run_dsec("ps", "--node", "node2", "--json", env={"DSEC_NODE_AGENT": "stdio"})
    assert isinstance(json.loads(out.stdout), list)


def test_idle_service_exits_and_leaves_nothing(dsec_home: Path) -> None:
    agents = Path(tempfile.mkdtemp(prefix="dsec-a-", dir="/tmp"))  # short: socket path limit
    try:
        env = {**os.environ, "DSEC_AGENT_DIR": str(agents), "DSEC_AGENT_IDLE": "1"}
        p = subprocess.run([sys.executable, "-m", "dsec_cli", "agent", "--resident"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout)
        assert info["protocol"] == PROTOCOL_VERSION and Path(info["socket"]).is_socket()
        _wait_gone(int(info["pid"]))
        left = sorted(f.suffix for f in agents.iterdir())
        assert ".sock" not in left and ".pid" not in left, left
    finally:
        for f in agents.iterdir():
            f.unlink()
        agents.rmdir()


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_idle_setting_is_refused(dsec_home: Path, value: str) -> None:
    agents = Path(tempfile.mkdtemp(prefix="dsec-a-", dir="/tmp"))
    try:
        env = {**os.environ, "DSEC_AGENT_DIR": str(agents), "DSEC_AGENT_IDLE": value}
        p = subprocess.run([sys.executable, "-m", "dsec_cli", "agent", "--resident"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and "DSEC_AGENT_IDLE" in p.stderr, p.stderr
        assert not list(agents.glob("*.sock"))
    finally:
        for f in agents.iterdir():
            f.unlink()
        agents.rmdir()
