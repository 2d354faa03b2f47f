"""The fast launcher (dsec_cli/cli/fast.py): plain `exec`, `run -d` and `ps` run without typer,
rich or the remote-store libraries, and give what the typer commands give; every other form
goes to typer unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_cli.cli import fast

from .conftest import IMAGE, leaks

#: what a plain hot command must not import
HEAVY = ("typer", "click", "pydantic", "rich", "boto3", "botocore", "oras", "yaml",
         "dsec_cli.backends.fnpool", "dsec_cli.cli.group", "dsec_cli.cli.sandbox")


def _run(env: dict[str, str], argv: list[str], via_typer: bool = False,
         input: bytes | None = None, heavy: tuple[str, ...] = HEAVY
         ) -> tuple[int, bytes, bytes, list[str]]:
    """`dsec ARGV` in a fresh interpreter (through typer when asked); exit code, output,
    and the HEAVY modules loaded at exit."""
    entry = ("from dsec_cli.cli.group import app\napp()\n" if via_typer else
             "from dsec_cli.cli import main\nmain()\n")
    code = ("import atexit, json, os, sys\n"
            f"heavy = {heavy!r}\n"
            "atexit.register(lambda: os.write(2, ('\\nLOADED ' + json.dumps("
            "sorted(m for m in heavy if m in sys.modules)) + '\\n').encode()))\n"
            "sys.argv = ['dsec', *sys.argv[1:]]\n" + entry)
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, input=input,
                       env={**os.environ, **env}, timeout=300)
    err, _, loaded = p.stderr.rpartition(b"\nLOADED ")
    return p.returncode, p.stdout, err, json.loads(loaded)


def test_plain_hot_commands_skip_typer_and_match_it(node_env: dict[str, str]) -> None:
    rc, out, err, loaded = _run(node_env, ["run", "-d", "--memory", "64M", IMAGE])
    assert rc == 0, err
    assert loaded == [], loaded
    sid = out.decode().strip()
    try:
        argv = ["exec", "-e", "A=1", "--workdir=/etc", sid, "--", "sh", "-c",
                "cat; echo $A; pwd; echo err >&2; exit 3"]
        fast_run = _run(node_env, argv, input=b"piped\n")
        typer_run = _run(node_env, argv, via_typer=True, input=b"piped\n")
        assert fast_run[0] == typer_run[0] == 3
        assert fast_run[1] == typer_run[1] == b"piped\n1\n/etc\n"
        assert fast_run[2].strip() == typer_run[2].strip() == b"err"
        assert fast_run[3] == [], fast_run[3]
        rc, out, err, loaded = _run(node_env, ["ps", "--json"])
        assert rc == 0 and loaded == [], (err, loaded)
        assert [r["id"] for r in json.loads(out)] == [sid]
        # a sandbox error exits as through typer, with the message
        rc, _, err, _ = _run(node_env, ["exec", "nosuchid", "--", "true"])
        assert rc == 2 and b"no sandbox" in err
    finally:
        subprocess.run([sys.executable, "-m", "dsec_cli", "rm", sid],
                       env={**os.environ, **node_env}, check=True, capture_output=True)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_usage_errors_still_come_from_typer(node_env: dict[str, str]) -> None:
    for argv in (["exec", "x", "--", "true", "--timeout"],  # after --: the command's own
                 ["exec", "--timeout", "soon", "x", "--", "true"],
                 ["run", "-d", "--pids", "many", IMAGE]):
        rc, _, err, loaded = _run(node_env, argv)
        if argv[-1] == "--timeout":
            assert rc == 2 and b"no sandbox" in err  # parsed by the launcher: x is looked up
            continue
        assert rc == 2, (argv, err)
        assert "typer" in loaded  # refused by typer's own parser, with its usage message
        assert b"Usage" in err or b"Invalid value" in err, err


@pytest.mark.parametrize("argv", [
    ["exec", "ID"],                          # no command
    ["exec", "ID", "ls"],                    # a command without --: typer decides
    ["exec", "ID", "--", ],                  # empty command
    ["exec", "--help"],
    ["exec", "--bogus", "ID", "--", "true"],
    ["exec", "--timeout", "1e3", "ID", "--", "true"],  # a float typer may read otherwise
    ["exec", "-we", "ID", "--", "true"],     # bundled short options
    ["run", IMAGE, "--", "true"],            # run without -d
    ["run", "-d", IMAGE, "--", "true"],
    ["run", "-d", "--detach=1", IMAGE],
    ["run", "-d", "--egres", "host:80", IMAGE],  # an unknown flag
    ["run", "-d", "--network", "allowlist", "--egress", "", IMAGE],
    ["ps", "extra"],
    ["ps", "--json", "--", "x"],
    ["rm", "ID"],
    [],
])
def test_launcher_leaves_other_forms_to_typer(argv: list[str]) -> None:
    assert fast.run(argv) is None


def test_launcher_parses_plain_forms() -> None:
    opts, pos, cmd = fast._parse(["--node", "n1", "-e", "A=1", "--env=B=2", "--timeout", "2.5",
                                  "--json", "ID", "--", "ls", "--all"], fast._EXEC)
    assert opts == {"node": "n1", "env": ["A=1", "B=2"], "timeout": 2.5, "json_out": True}
    assert pos == ["ID"] and cmd == ["ls", "--all"]
    opts, pos, cmd = fast._parse(["-d", "-b", "fncall", "--cpus", "0.5", "--pids", "64", IMAGE],
                                 fast._RUN)
    assert opts == {"detach": True, "backend": "fncall", "cpus": 0.5, "pids": 64}
    assert pos == [IMAGE] and cmd is None
    opts, pos, _ = fast._parse(["-d", "--network", "allowlist", "--egress", "host:80",
                                "--egress=10.0.0.1:443", IMAGE], fast._RUN)
    assert opts == {"detach": True, "network": "allowlist",
                    "egress": ["host:80", "10.0.0.1:443"]}


def _server_pids(runtime: str) -> set[int]:
    """Command servers whose socket lies under ``runtime``."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if any(a.startswith(runtime.encode() + b"/cli/") for a in args):
                out.add(int(d))
    return out


def _poll(what: str, fn: object) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if fn():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_command_server_serves_and_killing_it_breaks_nothing(node_env: dict[str, str]) -> None:
    import signal
    import tempfile
    import time

    runtime = tempfile.mkdtemp(prefix="dsec-r-", dir="/tmp")
    env = {**node_env, "DSEC_RUNTIME_DIR": runtime, "DSEC_CLI_SERVER": "60"}
    rc, out, err, _ = _run(node_env, ["run", "-d", IMAGE])
    assert rc == 0, err
    sid = out.decode().strip()
    try:
        # the first call runs in-process and starts a server for the next ones
        assert _run(env, ["exec", sid, "--", "echo", "one"])[:2] == (0, b"one\n")
        _poll("a command server's socket", lambda: list(Path(runtime).glob("cli/*.sock")))
        rc, out, err, loaded = _run(env, ["exec", sid, "--", "sh", "-c", "cat; exit 5"],
                                    input=b"through the server\n",
                                    heavy=(*HEAVY, "dsec_cli.api.sandboxes", "dsec_cli.run.node"))
        assert (rc, out) == (5, b"through the server\n"), err
        assert loaded == [], loaded  # the client imported none of the command's code
        # killed mid-command: that call fails clearly, and is not run a second time
        marker = f"/tmp/{os.path.basename(runtime)}"
        p = subprocess.Popen([sys.executable, "-m", "dsec_cli", "exec", sid, "--", "sh", "-c",
                              f"echo x >> {marker}; sleep 30"], env={**os.environ, **env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _poll("the command to start", lambda: _marker_lines(sid, node_env, marker) == 1)
        for pid in _server_pids(runtime):
            os.kill(pid, signal.SIGKILL)
        _, perr = p.communicate(timeout=120)
        assert p.returncode == 1 and b"command server stopped" in perr, perr
        # the next call runs in-process (the dead socket is no server) and starts a new one
        assert _run(env, ["exec", sid, "--", "echo", "two"])[:2] == (0, b"two\n")
        assert _marker_lines(sid, node_env, marker) == 1
        # an idle server exits by itself and takes its socket along
        for pid in _server_pids(runtime):
            os.kill(pid, signal.SIGKILL)
        _poll("no server", lambda: not _server_pids(runtime))
        for old in Path(runtime).glob("cli/*.sock"):
            old.unlink()
        idle = {**env, "DSEC_CLI_SERVER": "5"}
        assert _run(idle, ["exec", sid, "--", "true"])[0] == 0
        _poll("a server with 5 s idle", lambda: list(Path(runtime).glob("cli/*.sock")))
        _poll("it to exit", lambda: not _server_pids(runtime))
        time.sleep(0.2)
        assert not list(Path(runtime).glob("cli/*.sock"))
    finally:
        for pid in _server_pids(runtime):
            os.kill(pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-m", "dsec_cli", "rm", sid],
                       env={**os.environ, **node_env}, check=True, capture_output=True)
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def _marker_lines(sid: str, env: dict[str, str], marker: str) -> int:
    p = subprocess.run([sys.executable, "-m", "dsec_cli", "exec", sid, "--", "sh", "-c",
                        f"cat {marker} 2>/dev/null || true"], env={**os.environ, **env},
                       capture_output=True, timeout=120)
    return len(p.stdout.splitlines())


def test_command_server_in_a_shared_directory_is_never_used(node_env: dict[str, str]) -> None:
    """A server directory others may write to (where anyone could plant a socket that would
    receive the client's stdin and stdout) is neither used nor served from."""
    import shutil
    import socket
    import tempfile

    runtime = tempfile.mkdtemp(prefix="dsec-r-", dir="/tmp")
    try:
        shared = Path(runtime, "cli")
        shared.mkdir(mode=0o777)
        shared.chmod(0o777)
        env = {**node_env, "DSEC_RUNTIME_DIR": runtime, "DSEC_CLI_SERVER": "60"}
        rc, out, err, loaded = _run(env, ["ps", "--json"])
        assert rc == 0 and json.loads(out) is not None, err
        assert not _server_pids(runtime)
        # a planted listener is never connected to
        from dsec_cli.cli import served

        planted = socket.socket(socket.AF_UNIX)
        with planted:
            old = os.environ.copy()
            os.environ.clear()
            os.environ.update({**old, **env})
            try:
                planted.bind(str(shared / f"{served.server_key()}.sock"))
            finally:
                os.environ.clear()
                os.environ.update(old)
            planted.listen(1)
            planted.settimeout(0.5)
            assert _run(env, ["ps", "--json"])[0] == 0
            with pytest.raises(TimeoutError):
                planted.accept()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_command_server_starts_on_demand_by_default(node_env: dict[str, str]) -> None:
    """Without DSEC_CLI_SERVER: a one-off call leaves no process, a second call of the same
    environment starts a server that serves the next ones (log messages reach the client's
    stderr, a state dir made anew is seen as new); ``DSEC_CLI_SERVER=0`` never starts one."""
    import shutil
    import signal
    import tempfile

    runtime = tempfile.mkdtemp(prefix="dsec-r-", dir="/tmp")
    state = tempfile.mkdtemp(prefix="dsec-s-", dir="/tmp")
    env = {**node_env, "DSEC_RUNTIME_DIR": runtime, "DSEC_STATE_DIR": state}
    sid = None
    try:
        off = {**env, "DSEC_CLI_SERVER": "0"}
        for _ in range(3):
            assert _run(off, ["ps", "--json"])[:2] == (0, b"[]\n")
        assert not _server_pids(runtime)
        base = dict(os.environ)  # restored after: the rest of the suite runs in-process
        os.environ.pop("DSEC_CLI_SERVER", None)
        try:
            assert _run(env, ["ps", "--json"])[:2] == (0, b"[]\n")
            assert not _server_pids(runtime)  # one call: no server
            assert _run(env, ["ps", "--json"])[:2] == (0, b"[]\n")
            _poll("a server", lambda: list(Path(runtime).glob("cli/*.sock")))
            _poll("its pid", lambda: _server_pids(runtime))
            # a served create: the client imports none of it, its debug log reaches stderr
            debug = {**env, "DSEC_LOG": "DEBUG"}
            for _ in range(2):
                _run(debug, ["ps"])
            _poll("the debug server", lambda: len(list(
                Path(runtime).glob("cli/*.sock"))) == 2)
            rc, out, err, loaded = _run(debug, ["run", "-d", IMAGE],
                                        heavy=(*HEAVY, "dsec_cli.run.node"))
            assert rc == 0 and loaded == [], (err, loaded)
            assert b"DEBUG dsec_cli" in err, err
            sid = out.decode().strip()
            assert json.loads(_run(env, ["ps", "--json"])[1])[0]["id"] == sid
            subprocess.run([sys.executable, "-m", "dsec_cli", "rm", sid], check=True,
                           env={**os.environ, **off}, capture_output=True)
            sid = None
            # the state dir removed and made again: the server reads the new one
            shutil.rmtree(state)
            rc, out, err, _ = _run(off, ["run", "-d", IMAGE])
            assert rc == 0, err
            sid = out.decode().strip()
            assert [r["id"] for r in json.loads(_run(env, ["ps", "--json"])[1])] == [sid]
            # a sandbox process the server started (fncall: its own child) and another
            # process removed is collected, not left a zombie of the server
            rc, out, err, loaded = _run(env, ["run", "-d", "-b", "fncall", IMAGE],
                                        heavy=("dsec_cli.run.node",))
            assert rc == 0 and loaded == [], (err, loaded)
            fsid = out.decode().strip()
            from dsec_cli.run.node import Node

            pid = Node(state).lookup(fsid).handle["pid"]  # type: ignore[index]
            assert Path(f"/proc/{pid}").exists()
            subprocess.run([sys.executable, "-m", "dsec_cli", "rm", fsid], check=True,
                           env={**os.environ, **off}, capture_output=True)
            _poll("the fncall process to be collected", lambda: not Path(f"/proc/{pid}").exists())
        finally:
            os.environ.clear()
            os.environ.update(base)
    finally:
        for pid in _server_pids(runtime):
            os.kill(pid, signal.SIGKILL)
        if sid is not None:
            subprocess.run([sys.executable, "-m", "dsec_cli", "rm", sid], check=True,
                           env={**os.environ, **env, "DSEC_CLI_SERVER": "0"},
                           capture_output=True)
        left = leaks(state)
        shutil.rmtree(runtime, ignore_errors=True)
        if left == {"mounts": [], "cgroups": [], "dirs": []}:
            shutil.rmtree(state, ignore_errors=True)
    assert left == {"mounts": [], "cgroups": [], "dirs": []}
