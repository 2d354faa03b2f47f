"""Another local user is hostile: root's SSH control sockets and their lock files, its
command server and its resident node service are reached only by root itself.

The other user is uid 65534: its directories, symlinks and sockets are made under the
test's own dirs and chowned to it, and its listening sockets are served by a child process
that has dropped to that uid before ``listen`` (so SO_PEERCRED names it). Root's side is
the real `dsec` command run as a subprocess with an ``XDG_RUNTIME_DIR`` or ``TMPDIR`` that
the other user owns, as under ``sudo -E`` or ``su`` without ``-``. A client of another uid
is played by a child that keeps root's file access (fsuid 0) with euid 65534: it reaches
the socket as a wall that is missing would let it, and the server sees uid 65534. Every
canary is in the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.cli import served
from dsec_cli.core import rundir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")

OTHER = 65534
CANARY = b"the canary's own bytes\n"
WAIT = 60  # seconds any one step may take: a hang fails, it never blocks the suite


@pytest.fixture
def short(tmp_path: Path) -> Iterator[Path]:
    """A directory of the test's own with a short path (unix socket names fit 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-lu-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    p = tmp_path / "canary"
    p.write_bytes(CANARY)
    return p


def _untouched(canary: Path) -> None:
    st = os.lstat(canary)
    assert stat.S_ISREG(st.st_mode) and canary.read_bytes() == CANARY


def _theirs(path: Path) -> Path:
    """``path`` made a private directory of the other user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(path, OTHER, OTHER)
    return path


def _ours(path: Path) -> Path:
    """``path`` made a private directory of root's, with the ones it needs above it."""
    if not path.parent.exists():
        _ours(path.parent)
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A root `dsec` call's environment: the test's own state and config, the command
    server on its default (on demand), whatever the case adds."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DSEC_CLI_SERVER", "DSEC_RUNTIME_DIR", "XDG_RUNTIME_DIR", "TMPDIR",
                        "DSEC_SSH_CONTROL_DIR", "DSEC_AGENT_DIR")}
    env.update({"DSEC_STATE_DIR": str(tmp_path / "state"),
                "DSEC_CONFIG": str(tmp_path / "config.yaml")}, **extra)
    return env


def _dsec(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsec_cli", *argv], env=env, text=True,
                          capture_output=True, timeout=WAIT, stdin=subprocess.DEVNULL)


def _said(p: subprocess.CompletedProcess[str]) -> str:
    """What the call wrote to stderr, its lines as the terminal width wrapped them joined."""
    return " ".join(p.stderr.split())


def _in(env: dict[str, str], expr: str) -> str:
    """``expr`` evaluated by dsec's own code in a process with ``env``."""
    p = subprocess.run([sys.executable, "-c", f"print({expr})"], env=env, text=True,
                       capture_output=True, timeout=WAIT, check=True)
    return p.stdout.strip()


# -- another user's listener, another user's client ------------------------------------------
_FAKE_SERVER = textwrap.dedent("""
    import os, socket, sys
    path, chown = sys.argv[1], sys.argv[2] == "chown"
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    if chown:
        os.chown(path, {uid}, {uid})
    os.setgroups([]); os.setgid({uid}); os.setuid({uid})
    s.listen(8)  # SO_PEERCRED of a client's connection names who called listen
    print("ready", flush=True)
    s.settimeout({wait})
    while True:
        c, _ = s.accept()
        msg, anc, _, _ = c.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
        fds = [int.from_bytes(d[i:i + 4], sys.byteorder) for _, _, d in anc
               for i in range(0, len(d) - 3, 4)]
        for fd in fds:
            os.close(fd)  # the caller's pipes are let go: its call ends, and tells
        print("got", len(fds), "fds", flush=True)
        try:
            c.sendall(b"code 0")
        except OSError:
            pass  # the caller hung up: it did not take this server
        c.close()
""").format(uid=OTHER, wait=WAIT)

_OTHER_CLIENT = textwrap.dedent("""
    import array, ctypes, json, os, socket, sys
    path, kind = sys.argv[1], sys.argv[2]
    os.setresuid(0, {uid}, 0)
    ctypes.CDLL(None).setfsuid(0)  # root's file access: as if the socket's mode let us in
    c = socket.socket(socket.AF_UNIX)
    c.settimeout({wait})
    c.connect(path)
    out = {{"answer": "", "output": ""}}
    if kind == "command":
        r, w = os.pipe()
        fds = array.array("i", [w, w, w])
        try:
            c.sendmsg([b"ps\\0--json"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            c.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        os.close(w)
    else:
        try:
            c.sendall(b'{{"id": 1, "op": "hello", "args": {{"version": %d}}}}\\n'
                      % int(sys.argv[3]))
        except OSError:
            pass  # refused already
    data = b""
    try:
        while chunk := c.recv(4096):
            data += chunk
            if kind != "command" and data.endswith(b"\\n"):
                break
    except OSError:
        pass
    out["answer"] = data.decode(errors="replace")
    if kind == "command":
        os.set_blocking(r, False)
        try:
            out["output"] = os.read(r, 4096).decode(errors="replace")
        except BlockingIOError:
            pass
    print(json.dumps(out))
""").format(uid=OTHER, wait=WAIT)


class _Fake:
    """Another user's process listening on ``path``; what it received."""

    def __init__(self, path: Path, chown: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _FAKE_SERVER, str(path),
                                      "chown" if chown else "keep"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def received(self) -> list[str]:
        self.proc.kill()
        out, _ = self.proc.communicate(timeout=WAIT)
        return out.splitlines()


def _as_other_client(path: Path, kind: str) -> dict[str, str]:
    from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION

    p = subprocess.run([sys.executable, "-c", _OTHER_CLIENT, str(path), kind,
                        str(PROTOCOL_VERSION)], capture_output=True, text=True, timeout=WAIT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    import time

    deadline = time.monotonic() + WAIT
    while not path.is_socket():
        assert proc.poll() is None, "the server exited at start"
        assert time.monotonic() < deadline, f"no socket at {path}"
        time.sleep(0.05)


# -- the command server ---------------------------------------------------------------------
def test_server_dir_is_rundirs_cli_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """served.py's light copy of the runtime dir rules gives rundir's answer: with
    DSEC_RUNTIME_DIR, for root with another user's XDG_RUNTIME_DIR (passed over), and for a
    user with an XDG_RUNTIME_DIR of its own."""
    foreign = _theirs(tmp_path / "xdg")
    monkeypatch.delenv("DSEC_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(foreign))
    assert served.server_dir() == str(rundir.runtime_dir("cli"))
    assert served.ROOT_RUNTIME == rundir.ROOT_RUNTIME
    monkeypatch.setenv("DSEC_RUNTIME_DIR", str(tmp_path / "rt"))
    assert served.server_dir() == str(rundir.runtime_dir("cli")) == str(tmp_path / "rt/cli")
    # a user of its own XDG_RUNTIME_DIR (uid 65534 here: the dirs are made its own first)
    monkeypatch.delenv("DSEC_RUNTIME_DIR")
    for d in (foreign, foreign / "dsec", foreign / "dsec" / "cli"):
        _theirs(d)
    monkeypatch.setattr(os, "geteuid", lambda: OTHER)
    assert served.server_dir() == str(rundir.runtime_dir("cli")) == str(foreign / "dsec/cli")
    # a runtime dir another user may enter is refused by both
    (foreign / "dsec").chmod(0o755)
    assert served.server_dir() is None
    with pytest.raises(rundir.UnsafePathError):
        rundir.runtime_dir("cli")


@pytest.mark.parametrize("chown", [True, False], ids=["socket-theirs", "listener-theirs"])
def test_another_users_command_server_gets_no_stdio(tmp_path: Path, short: Path,
                                                    chown: bool) -> None:
    """Root's `dsec ps` under another user's XDG_RUNTIME_DIR: a server of that user,
    listening where the XDG dir puts root's server (a root-owned dir there, as after a swap
    between check and connect) and in root's own runtime dir, gets no descriptors and does
    not answer in the command's place: the call runs in-process and prints real output."""
    xdg = _theirs(tmp_path / "xdg")
    env = _env(tmp_path, XDG_RUNTIME_DIR=str(xdg), DSEC_RUNTIME_DIR=str(short / "rt"),
               DSEC_LOG="DEBUG")
    key = _in(env, "__import__('dsec_cli.cli.served').cli.served.server_key()")
    fakes = [_Fake(_ours(xdg / "dsec-cli-0") / f"{key}.sock", chown),
             _Fake(_ours(short / "rt" / "cli") / f"{key}.sock", chown)]
    try:
        p = _dsec(env, "ps", "--json")
    finally:
        got = [f.received() for f in fakes]
    assert all(line == "got 0 fds" for lines in got for line in lines), got
    assert p.returncode == 0 and json.loads(p.stdout) == [], (p.stdout, p.stderr)
    why = "is not a socket this user made" if chown else "runs as uid 65534"
    assert f"{why}: running in-process" in _said(p)  # the debug log says why


def test_root_server_is_not_in_another_users_xdg_dir(tmp_path: Path) -> None:
    """Without DSEC_RUNTIME_DIR, root's call with another user's XDG_RUNTIME_DIR looks for
    its server in /run/dsec/cli only: a fake where the XDG dir would have it is never
    reached."""
    xdg = _theirs(tmp_path / "xdg")
    env = _env(tmp_path, XDG_RUNTIME_DIR=str(xdg))
    key = _in(env, "__import__('dsec_cli.cli.served').cli.served.server_key()")
    fake = _Fake(_ours(xdg / "dsec-cli-0") / f"{key}.sock", chown=False)
    try:
        p = _dsec(env, "ps", "--json")
    finally:
        got = fake.received()
        Path(rundir.ROOT_RUNTIME, "cli", f"{key}.seen").unlink(missing_ok=True)
    assert all(line == "got 0 fds" for line in got), got
    assert p.returncode == 0 and json.loads(p.stdout) == [], (p.stdout, p.stderr)


def test_command_server_refuses_a_client_of_another_uid(tmp_path: Path, short: Path) -> None:
    d = _ours(short / "cli")
    sock = d / "k.sock"
    env = _env(tmp_path)
    server = subprocess.Popen([sys.executable, "-c", "import sys; from dsec_cli.cli.server "
                               "import serve; serve(sys.argv[1], 60.0)", str(sock)], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        _wait_for(sock, server)  # type: ignore[arg-type]
        assert _as_other_client(sock, "command") == {"answer": "", "output": ""}
        # its own user is served
        answer, output = _own_client_command(sock)
        assert answer == "code 0" and json.loads(output) == [], (answer, output)
    finally:
        server.kill()
        server.communicate(timeout=WAIT)


def _own_client_command(sock: Path) -> tuple[str, str]:
    import array
    import socket

    r, w = os.pipe()
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(WAIT)
        c.connect(str(sock))
        c.sendmsg([served.encode_request(["ps", "--json"])],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w, w, w]))])
        c.shutdown(socket.SHUT_WR)
        os.close(w)
        answer = b""
        while chunk := c.recv(4096):
            answer += chunk
    with os.fdopen(r) as f:
        return answer.decode(), f.read()


def test_a_planted_lock_symlink_is_not_followed_by_the_server(short: Path,
                                                              canary: Path) -> None:
    """The server's lock file is opened beneath its dir without following a symlink (and
    a dir not private to the server is never served from)."""
    d = _ours(short / "cli")
    (d / "k.lock").symlink_to(canary)
    theirs = _theirs(short / "theirs")
    (theirs / "k.lock").symlink_to(canary)
    for sock in (d / "k.sock", theirs / "k.sock"):
        p = subprocess.run([sys.executable, "-c", "import sys; from dsec_cli.cli.server "
                            "import serve; serve(sys.argv[1], 60.0)", str(sock)],
                           capture_output=True, text=True, timeout=WAIT)
        assert p.returncode == 0 and "not serving from" in p.stderr, p.stderr
        assert not sock.exists()
        _untouched(canary)


# -- the resident node service ----------------------------------------------------------------
def test_node_service_refuses_a_client_of_another_uid(tmp_path: Path, short: Path) -> None:
    import socket

    from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION, decode, encode

    sock = _ours(short / "node") / "n.sock"
    server = subprocess.Popen([sys.executable, "-m", "dsec_cli", "agent", "--listen",
                               str(sock)], env=_env(tmp_path), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for(sock, server)  # type: ignore[arg-type]
        assert _as_other_client(sock, "node")["answer"] == ""
        with socket.socket(socket.AF_UNIX) as c:  # its own user is served
            c.settimeout(WAIT)
            c.connect(str(sock))
            c.sendall(encode({"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION}}))
            with c.makefile("rb") as r:
                assert decode(r.readline())["ok"]
    finally:
        server.kill()
        server.communicate(timeout=WAIT)


def _resident(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    p = _dsec(env, "agent", "--resident")
    if p.returncode == 0:  # the service this call started: stopped by its pid
        os.kill(int(json.loads(p.stdout)["pid"]), 9)
    return p


def test_resident_dir_passes_over_another_users_xdg_dir(tmp_path: Path, short: Path) -> None:
    xdg = _theirs(tmp_path / "xdg")
    (xdg / "dsec-node").symlink_to(_theirs(tmp_path / "elsewhere"))
    p = _resident(_env(tmp_path, XDG_RUNTIME_DIR=str(xdg), DSEC_RUNTIME_DIR=str(short),
                       DSEC_AGENT_IDLE="60"))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["socket"].startswith(f"{short}/node/")
    assert os.listdir(tmp_path / "elsewhere") == []


@pytest.mark.parametrize("planted", ["lock", "log", "pid"])
def test_planted_symlink_in_the_resident_dir_is_not_followed(tmp_path: Path, short: Path,
                                                             canary: Path,
                                                             planted: str) -> None:
    d = _ours(short / "node")
    env = _env(tmp_path, DSEC_AGENT_DIR=str(d), DSEC_AGENT_IDLE="60")
    key = _in(env, "__import__('dsec_cli.run.cluster.resident').run.cluster.resident"
                   ".service_key(None)")
    (d / f"{key}.{planted}").symlink_to(canary)
    p = _resident(env)
    assert p.returncode == 2 and "is a symlink" in _said(p), p.stderr
    assert "Traceback" not in p.stderr
    _untouched(canary)
    assert not (d / f"{key}.sock").exists()


def test_another_users_resident_dir_is_refused(tmp_path: Path, canary: Path) -> None:
    d = _theirs(tmp_path / "agents")
    p = _resident(_env(tmp_path, DSEC_AGENT_DIR=str(d)))
    assert p.returncode == 2 and f"{d}: is owned by uid {OTHER}" in _said(p), p.stderr
    assert os.listdir(d) == []


# -- the ssh control dir ----------------------------------------------------------------------
def _node_config(tmp_path: Path) -> None:
    """One node whose sshd is not there (a closed loopback port): the control dir is
    used before any connection is tried."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "known_hosts").touch()
    (tmp_path / "config.yaml").write_text(json.dumps({"nodes": {"n1": {
        "address": f"root@127.0.0.1:{port}", "known_hosts": str(tmp_path / "known_hosts")}}}))


def _control_path(env: dict[str, str]) -> Path:
    return Path(_in(env, "__import__('dsec_cli.run.cluster.registry').run.cluster.registry"
                         ".get_node('n1').entry.target.control_path"))


@pytest.mark.parametrize("where", ["own-dir", "their-dir", "their-tmpdir"])
def test_planted_symlink_in_the_ssh_control_dir_is_not_followed(tmp_path: Path, short: Path,
                                                                canary: Path,
                                                                where: str) -> None:
    """A lock file planted as a symlink, in a control dir of our own, in one the other user
    made (DSEC_SSH_CONTROL_DIR), or in the default one under the other user's TMPDIR: root
    never writes through it."""
    _node_config(tmp_path)
    if where == "own-dir":
        ctl = _ours(short / "ssh")
        env = _env(tmp_path, DSEC_SSH_CONTROL_DIR=str(ctl))
        name = _control_path(env).name
    elif where == "their-dir":
        ctl = _theirs(short / "ssh")
        env = _env(tmp_path, DSEC_SSH_CONTROL_DIR=str(ctl))
        name = _control_path(_env(tmp_path, DSEC_SSH_CONTROL_DIR=str(_ours(short / "x"))))\
            .name
    else:  # where a dsec that trusted TMPDIR would put it
        tmp = _theirs(short / "tmp")
        ctl = _theirs(tmp / "dsec-ssh-0")
        env = _env(tmp_path, TMPDIR=str(tmp), DSEC_RUNTIME_DIR=str(_ours(short / "rt")))
        name = _control_path(env).name
    (ctl / f"{name}.lock").symlink_to(canary)
    p = _dsec(env, "ps", "--node", "n1", "--json")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    _untouched(canary)
    if where == "own-dir":
        assert p.returncode == 2 and "is a symlink" in _said(p), p.stderr
    elif where == "their-dir":
        assert p.returncode == 2 and f"is owned by uid {OTHER}" in _said(p), p.stderr
    else:  # the runtime dir's own ssh dir was used: the node is simply unreachable
        assert "unreachable" in _said(p), p.stderr
        assert (short / "rt" / "ssh" / f"{name}.lock").is_file()
    assert sorted(os.listdir(ctl)) == [f"{name}.lock"]
