"""The dsec-agent protocol, against the real static agent on a unix socket in a temp dir."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.backends.base import UserIds
from dsec_cli.backends.sandbox_agent import agent_binary
from dsec_cli.backends.sandbox_agent.client import AgentClient
from dsec_cli.core.errors import NotFoundError, SandboxError, UsageError


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


def test_put_get_as_a_user_then_as_the_agent_again(agent: tuple[AgentClient, Path]) -> None:
    """PUT_AS/GET_AS take the user's ids for the one request: what is made (file and parents)
    is theirs, permissions refuse them, and the next plain request is the agent's again."""
    if os.geteuid() != 0:
        pytest.skip("an agent takes another user's ids only as root")
    c, _ = agent
    d = Path(tempfile.mkdtemp(prefix="dsec-agent-as-user-", dir="/tmp"))  # walkable by 1000
    try:
        _as_user_checks(c, d, UserIds(1000, 1001, (1002,)))
    finally:
        shutil.rmtree(d)


def _as_user_checks(c: AgentClient, d: Path, user: UserIds) -> None:
    d.chmod(0o755)
    top = d / "as-user"
    top.mkdir()
    top.chmod(0o777)
    c.put_file(str(top / "a" / "b" / "f"), b"mine", 0o600, user)
    for p in (top / "a", top / "a" / "b", top / "a" / "b" / "f"):
        assert (p.stat().st_uid, p.stat().st_gid) == (1000, 1001), p
    assert c.get_file(str(top / "a" / "b" / "f"), user) == b"mine"
    secret = d / "secret"
    secret.write_bytes(b"s")
    secret.chmod(0o640)
    os.chown(secret, 0, 1002)  # readable through the supplementary group only
    assert c.get_file(str(secret), user) == b"s"
    with pytest.raises(UsageError) as e:
        c.get_file(str(secret), UserIds(1000, 1001))
    assert e.value.errno == errno.EACCES
    with pytest.raises(UsageError) as e:
        c.put_file(str(secret), b"x", 0o644, user)
    assert e.value.errno == errno.EACCES
    closed = d / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(UsageError) as e:
        c.put_file(str(closed / "sub" / "f"), b"x", 0o644, user)
    assert e.value.errno == errno.EACCES
    c.put_file(str(closed / "sub" / "f"), b"root", 0o644)  # the agent's own ids again
    assert (closed / "sub" / "f").stat().st_uid == 0
    assert c.get_file(str(secret)) == b"s"


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


class _Collect:
    """A TreeSink that keeps what it is given."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, int, int, bytes, bytes]] = []
        self.chunks: list[tuple[int, bytes]] = []

    def entry(self, kind: str, mode: int, size: int, rel: bytes, target: bytes) -> None:
        self.entries.append((kind, mode, size, rel, target))

    def chunk(self, offset: int, data: memoryview) -> None:
        self.chunks.append((offset, bytes(data)))


def test_tree_sends_extents_and_symlinks_and_refuses_fifos(agent: tuple[AgentClient, Path]
                                                           ) -> None:
    import os

    c, d = agent
    root = d / "tree"
    (root / "sub").mkdir(parents=True)
    with open(root / "sub" / "sparse", "wb") as f:
        f.truncate(64 << 20)
        f.seek(32 << 20)
        f.write(b"x" * 10)
    (root / "link").symlink_to("/")
    sink = _Collect()
    c.get_tree(str(root), sink)
    kinds = {rel: (kind, size, target) for kind, _, size, rel, target in sink.entries}
    assert kinds == {b"": ("d", 0, b""), b"sub": ("d", 0, b""), b"link": ("l", 0, b"/"),
                     b"sub/sparse": ("f", 64 << 20, b"")}
    # only the data extent travels (filesystems round it to their block size)
    assert sum(len(b) for _, b in sink.chunks) <= 1 << 20
    assert any(b"x" * 10 in b for _, b in sink.chunks)
    os.mkfifo(root / "sub" / "fifo")
    with pytest.raises(UsageError, match="sub/fifo: is a FIFO"):
        c.get_tree(str(root), _Collect())
    with pytest.raises(UsageError, match="is a FIFO"):
        c.get_file(str(root / "sub" / "fifo"))  # returns at once: opened non-blocking
    assert c.ping().startswith("dsec-agent 1")


def test_put_stream_keeps_holes(agent: tuple[AgentClient, Path], tmp_path: Path) -> None:
    c, d = agent
    src = tmp_path / "sparse"
    with open(src, "wb") as f:
        f.truncate(256 << 20)
        f.seek(100 << 20)
        f.write(b"middle")
    with open(src, "rb") as f:
        assert c.put_stream(str(d / "in" / "sparse"), f, 0o600) == 256 << 20
    st = (d / "in" / "sparse").stat()
    assert st.st_size == 256 << 20 and st.st_blocks * 512 <= 1 << 20
    with open(d / "in" / "sparse", "rb") as f:
        f.seek(100 << 20)
        assert f.read(6) == b"middle"


def test_connect_refuses_a_listener_that_is_not_the_expected_one(
        agent: tuple[AgentClient, Path]) -> None:
    from dsec_cli.backends.sandbox_agent.client import AgentError

    _, d = agent
    with pytest.raises(AgentError, match="refusing the agent socket of sandbox x"):
        AgentClient.connect_unix(d / "s", peer=lambda pid: False, what="sandbox x")


def test_signal_frame_reaches_the_exec_process_group(agent: tuple[AgentClient, Path]) -> None:
    """SIGNAL (6) goes to the exec's process group: a trap in the shell sees SIGTERM, and
    SIGKILL ends the exec with 128+9, not as a timeout."""
    import signal as sig
    import time

    c, d = agent

    def started(flag: Path) -> None:
        deadline = time.monotonic() + 30
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert flag.exists(), "the exec never started"

    h = c.start_exec(["sh", "-c", f"trap 'echo got-term; exit 5' TERM; touch {d}/ready1; "
                      "while :; do sleep 0.05; done"], timeout=60)
    started(d / "ready1")
    h.signal(sig.SIGTERM)
    r = h.wait()
    assert (r.exit_code, r.timed_out) == (5, False) and b"got-term" in r.stdout, r
    h = c.start_exec(["sh", "-c", f"touch {d}/ready2; sleep 600"], timeout=60)
    started(d / "ready2")
    h.signal(sig.SIGKILL)
    r = h.wait()
    assert (r.exit_code, r.timed_out) == (137, False), r


def test_unknown_frame_is_answered_enosys(agent: tuple[AgentClient, Path]) -> None:
    """A request type the agent does not know gets RESULT ENOSYS with its id, and the
    connection keeps serving (docs/agent.md, Versioning)."""
    import errno
    import socket
    import struct

    _, d = agent

    def read_frame(s: socket.socket) -> tuple[int, int, bytes]:
        head = b""
        while len(head) < 9:
            more = s.recv(9 - len(head))
            assert more, "the agent closed the connection"
            head += more
        length, kind, rid = struct.unpack(">IBI", head)
        body = b""
        while len(body) < length - 5:
            more = s.recv(length - 5 - len(body))
            assert more, "the agent closed the connection"
            body += more
        return kind, rid, body

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(d / "s"))
        s.sendall(struct.pack(">IBI", 5, 99, 4242))  # type 99, id 4242, no payload
        kind, rid, body = read_frame(s)
        assert (kind, rid) == (19, 4242)  # RESULT, for that request
        assert struct.unpack(">i", body[:4])[0] == errno.ENOSYS, body
        s.sendall(struct.pack(">IBI", 5, 5, 7))  # PING on the same connection
        kind, rid, body = read_frame(s)
        assert (kind, rid) == (19, 7) and b"dsec-agent 1" in body, body


def test_malformed_identity_requests_change_nothing(agent: tuple[AgentClient, Path]) -> None:
    """The identity request (a restored VM's first) is checked whole before it acts: a name
    too long, a NUL inside it, or too few random bytes is refused and the host's name (this
    agent runs on the host) is untouched. Its effect in a guest: tests/backends/vm."""
    import socket

    from dsec_cli.backends.sandbox_agent.client import AgentError

    client = agent[0]
    before = socket.gethostname()
    for host, mid, seed in (("h" * 65, "m", os.urandom(64)), ("a\0b", "m", os.urandom(64)),
                            ("ok", "m", os.urandom(8)), ("ok", "m" * 65, os.urandom(64)),
                            ("ok", "m", os.urandom(513))):
        with pytest.raises(AgentError, match="malformed identity request"):
            client.identity(host, mid, seed)
    assert socket.gethostname() == before
    assert client.ping().startswith("dsec-agent 1")  # and the connection still serves


def test_exec_frames_keep_output_up_to_the_capture_limit_and_flag_the_cut() -> None:
    from dsec_cli.backends.sandbox_agent.client import (
        T_EXIT,
        T_RESULT,
        T_STDERR,
        T_STDOUT,
        AgentError,
        ExecFrames,
    )
    fold = ExecFrames(time.monotonic(), capture_limit=5)
    assert fold.add(T_STDOUT, b"abc") is None
    assert fold.add(T_STDERR, b"xy") is None
    assert fold.add(T_STDOUT, b"defgh") is None   # 2 of these 5 bytes fit
    assert fold.add(T_STDOUT, b"ijk") is None     # none fit
    res = fold.add(T_EXIT, struct.pack(">iI", 3, 1))
    assert res is not None
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (3, b"abcde", b"xy", True)
    assert (res.stdout_truncated, res.stderr_truncated) == (True, False)
    assert ExecFrames.stream(T_STDOUT) == "stdout" and ExecFrames.stream(T_EXIT) is None
    with pytest.raises(SandboxError, match="no such file"):
        ExecFrames(0.0, None).add(T_RESULT, struct.pack(">i", 2) + b"no such file")
    with pytest.raises(AgentError, match="lost the connection.*reset"):
        ExecFrames(0.0, None).add(-1, b"reset")
