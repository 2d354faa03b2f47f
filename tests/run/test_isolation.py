"""The SDK on one shared sandbox: results, files, isolation, network, limits, pause."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import NotFoundError, UsageError

from .conftest import IMAGE


@pytest.fixture(scope="module")
def sb(node_env: dict[str, str]) -> object:
    # module-scoped: made before the per-test environment, so it sets the node's itself
    with pytest.MonkeyPatch.context() as mp:
        for k, v in node_env.items():
            mp.setenv(k, v)
        with Sandbox.create(IMAGE, memory="64M", pids=32) as s:
            yield s


def test_exec_result_and_files(sb: Sandbox) -> None:
    r = sb.exec("echo hi; echo no >&2; exit 4")
    assert (r.exit_code, r.stdout, r.stderr) == (4, b"hi\n", b"no\n") and r.duration > 0
    sb.write_file("/srv/a.txt", "hello")
    assert sb.read_file("/srv/a.txt") == b"hello"
    assert sb.exec(["cat", "/srv/a.txt"]).stdout == b"hello"


def test_sees_only_its_image(sb: Sandbox) -> None:
    r = sb.exec("ls /; ls /work /root/.ssh /usr/bin/python3 2>&1; cat /proc/1/cmdline")
    assert b"No such file" in r.stdout and b"/.dsec/agent" in r.stdout
    assert set(r.stdout.split(b"\n")[0:1]) <= {b"bin"}
    # cp paths cannot escape: `..` and symlinks resolve inside the sandbox root
    sb.exec("ln -s / /tmp/root-link")
    host_only = Path("/etc/hostname").read_bytes()
    assert sb.read_file("/../../../../etc/hostname") == b"dsec\n" != host_only
    assert sb.read_file("/tmp/root-link/etc/hostname") == b"dsec\n"
    with pytest.raises(NotFoundError):
        sb.read_file("/../../work/wt-sandbox/pyproject.toml")


def test_no_network_by_default(sb: Sandbox, node_env: dict[str, str]) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = sb.exec(f"nc -w 2 127.0.0.1 {port} </dev/null; echo rc=$?; ip -o link | wc -l; "
                    "ip route", timeout=20)
        assert b"rc=1" in r.stdout and b"1\n" in r.stdout and b"default" not in r.stdout
        with Sandbox.create(IMAGE, network="host") as h:
            r = h.exec(f"echo ping | nc -w 2 127.0.0.1 {port}; echo rc=$?", timeout=20)
            conn, _ = srv.accept()
            assert conn.recv(10) == b"ping\n"
            conn.close()
    finally:
        srv.close()


def test_memory_hog_and_fork_bomb_are_contained(sb: Sandbox) -> None:
    r = sb.exec(["dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"])
    assert r.exit_code == 137 and r.oom_killed
    adj = sb.exec("cat /proc/self/oom_score_adj /proc/1/oom_score_adj").stdout.split()
    assert int(adj[0]) == 300 and int(adj[1]) < 300  # the OOM killer prefers execs to init
    # the exec's own shell forks its two children before the bomb saturates the pids
    # limit, then only waits, so it is the timeout that ends the exec (and kills the bomb)
    r = sb.exec("sleep 60 & sh -c 'bomb() { bomb | bomb & }; bomb' & wait", timeout=3)
    assert r.timed_out
    info = sb.info()
    assert info["pids"] <= 32
    assert sb.exec("echo alive").stdout == b"alive\n"  # the sandbox survives both


def test_pause_resume_and_bad_limits(sb: Sandbox) -> None:
    sb.pause()
    with pytest.raises(UsageError, match="paused"):
        sb.exec("true")
    sb.resume()
    assert sb.exec("true").exit_code == 0
    with pytest.raises(UsageError, match="memory"):
        Sandbox.create(IMAGE, memory=1024)
    with pytest.raises(NotFoundError):
        Sandbox.create("missing@0")


def test_fncall_backend_is_read_only(node_env: dict[str, str]) -> None:
    with Sandbox.create(IMAGE, backend="fncall", memory="64M") as f:
        r = f.exec("touch /etc/x; echo t > /tmp/t; cat /tmp/t")
        assert b"Read-only" in r.stderr and r.stdout == b"t\n"
        with pytest.raises(UsageError, match="read-only"):
            f.snapshot("nope@1")




def test_running_sandbox_pins_its_image_in_the_store(node_env: dict[str, str]) -> None:
    """Store gc keeps what runs: a pin per sandbox under pins/, gone once it is removed."""
    import json

    from dsec_cli.push.stores import open_store

    store = open_store(node_env["DSEC_STORE"])
    with Sandbox.create(IMAGE) as s:
        pins = [json.loads(store.get(i.key)) for i in store.list("pins/")]
        mine = [p for p in pins if p["sandbox"] == s.id]
        assert len(mine) == 1 and mine[0]["manifest"] == s.node.lookup(s.id).image_digest
    assert not [i for i in store.list("pins/") if i.key.endswith(s.id)]
