"""The dsec-agent protocol, against the real static agent on a unix socket in a temp dir."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.agent import agent_binary
from dsec_cli.agent.client import AgentClient
from dsec_cli.core.errors import NotFoundError, UsageError


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentClient, Path]]:
    d = tmp_path_factory.mktemp("agent")
    r, w = __import__("os").pipe()
    proc = subprocess.Popen([str(agent_binary()), "--listen", str(d / "s"), "--ready-fd", str(w)],
                            pass_fds=(w,))
    __import__("os").close(w)
    assert __import__("os").read(r, 1) == b"R"
    client = AgentClient.connect_unix(d / "s", peer=lambda pid: pid == proc.pid)
    yield client, d
    client.close()
    proc.kill()
    proc.wait()


def test_ping(agent: tuple[AgentClient, Path]) -> None:
    assert agent[0].ping().startswith("dsec-agent 1")


def test_exec_output_and_exit_code(agent: tuple[AgentClient, Path]) -> None:
    chunks: list[tuple[str, bytes]] = []
    r = agent[0].exec(["sh", "-c", "echo out; echo err >&2; exit 3"],
                      on_output=lambda s, b: chunks.append((s, b)))
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    assert ("stdout", b"out\n") in chunks


def test_exec_stdin_env_cwd(agent: tuple[AgentClient, Path]) -> None:
    c, d = agent
    big = b"x" * (3 << 20)
    assert c.exec(["cat"], stdin=big).stdout == big
    r = c.exec(["sh", "-c", "echo $FOO; pwd"], env={"FOO": "bar"}, cwd=str(d))
    assert r.stdout == f"bar\n{d}\n".encode()


def test_exec_timeout_and_missing_command(agent: tuple[AgentClient, Path]) -> None:
    c, _ = agent
    r = c.exec(["sleep", "30"], timeout=0.2)
    assert r.timed_out and r.exit_code == 137
    r = c.exec(["no-such-command"])
    assert r.exit_code == 127 and b"cannot execute" in r.stderr
    r = c.exec(["true"], cwd="/no/such/dir")
    assert r.exit_code == 126
    with pytest.raises(UsageError):
        c.exec([])


def test_background_child_does_not_hold_the_reply(agent: tuple[AgentClient, Path]) -> None:
    r = agent[0].exec(["sh", "-c", "sleep 30 & echo started"], timeout=10)
    assert r.stdout == b"started\n" and not r.timed_out


def test_concurrent_execs_on_one_stream(agent: tuple[AgentClient, Path]) -> None:
    c, _ = agent
    results: dict[int, bytes] = {}

    def one(i: int) -> None:
        results[i] = c.exec(["sh", "-c", f"sleep 0.1; echo {i}"]).stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n".encode() for i in range(16)}


def test_put_get_file(agent: tuple[AgentClient, Path]) -> None:
    c, d = agent
    data = bytes(range(256)) * 9000  # > 1 MiB: several PUT frames
    c.put_file(str(d / "sub" / "f.bin"), data, 0o640)
    assert (d / "sub" / "f.bin").read_bytes() == data
    assert c.get_file_with_mode(str(d / "sub" / "f.bin")) == (data, 0o640)
    with pytest.raises(NotFoundError):
        c.get_file(str(d / "missing"))
    with pytest.raises(UsageError):
        c.get_file(str(d))


def test_single_stream_mode_over_an_inherited_fd() -> None:
    """`--fd N`: the mode a VM's virtio-serial port uses (one stream, no listener)."""
    import socket

    host, guest = socket.socketpair()
    proc = subprocess.Popen([str(agent_binary()), "--fd", str(guest.fileno())],
                            pass_fds=(guest.fileno(),))
    guest.close()
    client = AgentClient(host)
    try:
        assert client.ping().startswith("dsec-agent 1")
        assert client.exec(["sh", "-c", "echo $((6 * 7))"]).stdout == b"42\n"
    finally:
        client.close()
        assert proc.wait() == 0  # EOF on its only stream ends the agent
