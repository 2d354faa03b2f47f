"""The SDK on one shared sandbox: results, files, isolation, network, limits, pause."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import NotFoundError, UsageError

from .conftest import IMAGE, REPO


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


def test_sees_only_its_image(sb: Sandbox, busybox_tar: Path) -> None:
    import tarfile

    with tarfile.open(busybox_tar) as t:
        top = {m.name.removeprefix("./").split("/")[0] for m in t.getmembers()} - {"", "."}
    r = sb.exec("ls -a /")
    # the image's top level, plus the agent's own directory: nothing of the host's (/srv
    # is made by another test of this shared sandbox)
    assert set(r.stdout.decode().split()) - {"srv"} == top | {".", "..", ".dsec"}, r.stdout
    assert sb.exec("cat /proc/1/cmdline").stdout.startswith(b"/.dsec/agent")
    # host paths that exist (checked here) are absent inside
    host = [str(REPO), "/etc/os-release", "/usr/bin/python3", str(Path(sys.executable))]
    assert all(Path(p).exists() for p in host)
    r = sb.exec(["sh", "-c", 'for p in "$@"; do [ -e "$p" ] && echo "SEEN $p"; done; true',
                 "sh", *host])
    assert r.exit_code == 0 and r.stdout == b"", r
    # cp paths cannot escape: `..` and symlinks resolve inside the sandbox root
    sb.exec("ln -s / /tmp/root-link")
    host_only = Path("/etc/hostname").read_bytes()
    assert sb.read_file("/../../../../etc/hostname") == b"dsec\n" != host_only
    assert sb.read_file("/tmp/root-link/etc/hostname") == b"dsec\n"
    assert (REPO / "pyproject.toml").exists()
    with pytest.raises(NotFoundError):
        sb.read_file(f"/../../../..{REPO}/pyproject.toml")
    with pytest.raises(NotFoundError):
        sb.read_file(f"/tmp/root-link{REPO}/pyproject.toml")


def test_no_network_by_default(sb: Sandbox, node_env: dict[str, str]) -> None:
    """A server on the host's loopback: unreachable from the default sandbox, which has only
    its own loopback and no route; reached from a sandbox with the host's network."""
    import threading

    got: list[bytes] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(60)
    port = srv.getsockname()[1]

    def serve() -> None:
        try:
            while True:
                conn, _ = srv.accept()
                with conn:
                    conn.settimeout(10)
                    got.append(conn.recv(10))
        except OSError:
            pass  # closed at the end of the test

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        r = sb.exec(f"echo ping | nc -w 2 127.0.0.1 {port}; echo rc=$?; ip -o link | wc -l; "
                    "ip route | wc -l", timeout=30)
        rc, links, routes = r.stdout.decode().split()
        assert (rc, links, routes) == ("rc=1", "1", "0"), r
        assert got == []
        with Sandbox.create(IMAGE, network="host") as h:
            r = h.exec(f"echo ping | nc -w 2 127.0.0.1 {port}; echo rc=$?", timeout=30)
            assert r.stdout.endswith(b"rc=0\n"), r
        assert got == [b"ping\n"]
    finally:
        srv.shutdown(socket.SHUT_RDWR)  # wakes the accept
        srv.close()
        t.join(30)
        assert not t.is_alive()


def test_memory_hog_and_fork_bomb_are_contained(sb: Sandbox) -> None:
    r = sb.exec(["dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"])
    assert r.exit_code == 137 and r.oom_killed
    adj = sb.exec("cat /proc/self/oom_score_adj /proc/1/oom_score_adj").stdout.split()
    assert int(adj[0]) == 300 and int(adj[1]) < 300  # the OOM killer prefers execs to init
    # 64 sleepers started at once: the pids limit (32) refuses the forks beyond it, and
    # they are counted while they all still live (a limit of 1024 would let every one run)
    # (once the limit is reached the rest runs on shell builtins only: no fork needed)
    r = sb.exec("(for i in $(seq 64); do sleep 60 & done; wait) 2>/tmp/forks & "
                "i=0; while [ ! -s /tmp/forks ] && [ $i -lt 2000000 ]; do i=$((i+1)); done; "
                "set -- /proc/[0-9]*; echo $#; while read -r l; do echo \"$l\"; done </tmp/forks; "
                "kill -9 -1", timeout=60)
    running = int(r.stdout.split(b"\n")[0])
    assert 20 <= running <= 32, r
    assert b"fork" in r.stdout, r  # the shell was refused a fork
    assert sb.info()["pids_max_hits"] > 0
    # a fork bomb is contained too: it runs into the limit, and the timeout ends the exec
    # (held open by its sleeper) and kills the bomb
    r = sb.exec("sleep 60 & sh -c 'bomb() { bomb | bomb & }; bomb' & wait", timeout=3)
    assert r.timed_out and r.pids_limited
    assert sb.info()["pids"] <= 32
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
