"""Bounded waits: a store endpoint or SSH node that accepts connections and never answers
fails the command within the configured timeouts, naming the endpoint; and a `dsec gc`
killed while deleting does not hold later pushes up.

The silent endpoint is a loopback TCP server started here that accepts every connection
and never sends a byte; it stops itself after two minutes whatever happens to the test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.format.refs import delete_ref
from dsec_cli.push.lease import DELETING, WriterLease, read_marker
from dsec_cli.push.stores import open_store
from dsec_cli.push.stores.base import Store
from dsec_cli.run.cluster.ssh import Address, SshTarget
from tests.push.helpers import build_layer, make_tree, raw_layer

REPO = Path(__file__).resolve().parents[2]
#: short waits for the tests; the defaults are checked separately
FAST = {"DSEC_CONNECT_TIMEOUT": "1s", "DSEC_READ_TIMEOUT": "2s"}


class SilentServer:
    """Accepts TCP connections on loopback and never answers; bounded in time."""

    def __init__(self, lifetime: float = 120.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._end = time.monotonic() + lifetime
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._end:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self._conns.append(conn)  # held open, never read from or written to
        for c in self._conns:
            c.close()
        self.sock.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.stop()


@pytest.fixture
def local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The default store, holding one small layer a@1."""
    url = (tmp_path / "local").as_uri()
    monkeypatch.setenv("DSEC_STORE", url)
    specs = tmp_path / "specs"
    make_tree(specs / "tree", seed=1, files=3)
    build_layer(url, specs, "a", "1")
    return url


def dsec(*args: str, env: dict[str, str] | None = None, timeout: float = 90
         ) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "-c", "from dsec_cli.cli import main; main()", *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                       env={**os.environ, "COLUMNS": "200", **(env or {})},
                       stdin=subprocess.DEVNULL)
    return p, time.monotonic() - t0


def assert_bounded(p: subprocess.CompletedProcess[str], took: float, where: str,
                   limit: float) -> None:
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert took < limit, f"took {took:.1f}s: {p.stderr}"
    assert where in p.stdout + p.stderr, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr


# -- the defaults ---------------------------------------------------------------------------
def test_default_waits_fail_a_dead_endpoint_within_30s(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    from dsec_cli.core.config import net_timeouts
    from dsec_cli.push.retry import RetryPolicy

    for var in ("DSEC_CONNECT_TIMEOUT", "DSEC_READ_TIMEOUT", "DSEC_SSH_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DSEC_CONFIG", str(tmp_path / "none.yaml"))
    t = net_timeouts()
    assert t.connect <= 10 and t.read <= 20 and t.total <= 30
    assert RetryPolicy.from_env().timeout_budget <= 30  # retries included
    argv = SshTarget(Address("root", "127.0.0.1", 2222)).base_argv()
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    assert int(opts["ConnectTimeout"]) <= 10
    assert int(opts["ServerAliveInterval"]) * int(opts["ServerAliveCountMax"]) <= 30


def test_timeouts_come_from_config_and_bad_ones_are_usage_errors(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dsec_cli.core.config import net_timeouts

    cfg = tmp_path / "config.yaml"
    cfg.write_text("connect_timeout: 3s\nread_timeout: 7s\n")
    monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    assert (net_timeouts().connect, net_timeouts().read) == (3, 7)
    monkeypatch.setenv("DSEC_READ_TIMEOUT", "nan")
    p, _ = dsec("ls", "--store", "oci://127.0.0.1:9/x?insecure=1")
    assert p.returncode == 2 and "DSEC_READ_TIMEOUT" in p.stderr and "Traceback" not in p.stderr


# -- silent stores --------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["push", "pull", "ls"])
def test_silent_s3_endpoint_fails_within_the_bound(silent: SilentServer, local_store: str,
                                                   verb: str) -> None:
    endpoint = f"http://127.0.0.1:{silent.port}"
    env = {**FAST, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    args = {"push": ["push", "a@1", "--to", "s3://bkt"],
            "pull": ["pull", "a@1", "--from", "s3://bkt"],
            "ls": ["ls", "--store", "s3://bkt"]}[verb]
    before = sorted(p.name for p in Path(local_store.removeprefix("file://")).rglob("*"))
    p, took = dsec(*args, env=env)
    assert_bounded(p, took, endpoint, 20)
    assert "did not answer" in " ".join(p.stderr.split())  # rich wraps long lines
    assert silent.accepted >= 1  # it did connect: the read timeout, not a refusal, fired
    assert sorted(p.name for p in Path(local_store.removeprefix("file://")).rglob("*")) == before


def test_silent_oci_registry_fails_within_the_bound(silent: SilentServer,
                                                    local_store: str) -> None:
    host = f"127.0.0.1:{silent.port}"
    p, took = dsec("push", "a@1", "--to", f"oci://{host}/x", "--insecure", env=FAST)
    assert_bounded(p, took, host, 20)
    assert "did not answer" in " ".join(p.stderr.split())
    p, took = dsec("pull", "a@1", "--from", f"oci://{host}/x", "--insecure", env=FAST)
    assert_bounded(p, took, host, 20)


def test_retries_of_timeouts_stay_within_the_budget(silent: SilentServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Five attempts of a 2 s read timeout would wait 10 s; the budget (1 + 2 s) stops it."""
    for k, v in FAST.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DSEC_STORE_RETRIES", "5")
    from dsec_cli.core.errors import StoreUnavailableError
    from dsec_cli.push.stores.retrying import open_retrying

    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{silent.port}.*gave up after"):
        open_retrying(f"oci://127.0.0.1:{silent.port}/x?insecure=1")
    assert time.monotonic() - t0 < 6


# -- silent SSH nodes -----------------------------------------------------------------------
def test_silent_ssh_node_fails_within_the_bound(silent: SilentServer, tmp_path: Path) -> None:
    env = {**FAST, "DSEC_SSH_CONTROL_DIR": str(tmp_path / "ctl"),
           "DSEC_SSH_CONFIG": "/dev/null"}
    where = f"127.0.0.1:{silent.port}"
    known = tmp_path / "known_hosts"
    known.write_text("")
    p, _ = dsec("node", "add", "n", f"root@{where}", "--known-hosts", str(known),
                "--no-check", env=env)
    assert p.returncode == 0, p.stderr
    # what starting dsec costs on this (busy) machine, so that the bounds below measure the
    # wait on the node: 1 s to connect, 3 s with retries; the old fixed 10 s fails them
    _, startup = dsec("version", env=env)
    p, took = dsec("node", "check", env=env)
    assert_bounded(p, took - startup, where, 7)
    p, took = dsec("node", "ls", "--json", env=env)
    assert took - startup < 7 and where in p.stdout and '"ok": false' in p.stdout, p.stdout
    p, took = dsec("exec", "n/abc123", "--", "true", env=env)
    assert_bounded(p, took - startup, where, 8)  # opening retries stop within connect + read
    p, took = dsec("node", "add", "m", f"root@{where}", "--known-hosts", str(known), env=env)
    assert_bounded(p, took - startup, where, 7)


# -- a killed gc ----------------------------------------------------------------------------
def _garbage_store(tmp_path: Path, packs: int) -> str:
    url = (tmp_path / "remote").as_uri()
    with open_store(url) as s:
        raw_layer(s, "old", "1", [os.urandom(256) for _ in range(packs)])
        delete_ref(s, "old@1")
    return url


def _objects(store: Store) -> int:
    return sum(1 for p in ("packs/", "indexes/", "manifests/") for _ in store.list(p))


def test_push_after_a_killed_gc_proceeds_at_once(tmp_path: Path, local_store: str) -> None:
    remote = _garbage_store(tmp_path, packs=40)
    store = open_store(remote)
    total = _objects(store)
    env = {**os.environ, "DSEC_DEBUG_DELAY_GC_DELETE": "0.5"}
    gc = subprocess.Popen([sys.executable, "-c", "from dsec_cli.cli import main; main()",
                           "gc", "--store", remote, "--grace", "0"], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while _objects(store) == total:  # wait until it is deleting
            assert gc.poll() is None and time.monotonic() < deadline, "gc never deleted"
            time.sleep(0.05)
        gc.send_signal(signal.SIGKILL)
        gc.wait(10)
    finally:
        if gc.poll() is None:
            gc.kill()
            gc.wait()
    left = _objects(store)
    assert 0 < left < total, "gc was not killed mid-delete"
    marker = read_marker(store)
    assert marker is not None and marker.expires > time.time()  # as the killed gc left it
    assert not marker.live()  # its process is gone on this machine: stale
    p, took = dsec("push", "a@1", "--to", remote, timeout=60)
    assert p.returncode == 0, p.stderr
    assert took < 15, f"push waited {took:.1f}s for a dead gc"
    assert "no longer runs" in " ".join(p.stderr.split())  # the stale marker is reported
    p, _ = dsec("gc", "--store", remote, "--grace", "0")  # the next gc finishes the job
    assert p.returncode == 0, p.stderr
    assert store.stat(DELETING) is None
    assert _objects(store) == len(list(store.list("packs/"))) + 2  # only a@1's objects left


def test_live_gc_marker_of_another_machine_still_blocks(tmp_path: Path) -> None:
    """The safety half: a marker whose process this machine cannot see is honoured until
    its heartbeat expires."""
    store = open_store(_garbage_store(tmp_path, packs=1))
    now = time.time()
    doc = {"purpose": "gc", "holder": "elsewhere:1", "started": now, "expires": now + 30,
           "process": {"host": "elsewhere", "boot": "x", "pidns": "pid:[1]", "pid": 1,
                       "start": "1"}}
    store.put(DELETING, json.dumps(doc).encode())
    from dsec_cli.core.errors import StoreError

    with pytest.raises(StoreError, match="being garbage-collected"):
        with WriterLease(store, "push", wait_timeout=0.5):
            pass


def test_gc_marker_is_a_short_heartbeat(tmp_path: Path) -> None:
    from dsec_cli.push.lease import GcMarker

    store = open_store(_garbage_store(tmp_path, packs=1))
    with GcMarker(store, ttl=1.2) as marker:
        first = read_marker(store)
        assert first is not None and first.live()
        assert first.expires - time.time() <= 1.2  # not the writers' 10-minute lease
        time.sleep(0.5)
        second = read_marker(store)
        assert second is not None and second.expires > first.expires  # renewed
        assert marker.may_delete()
    assert read_marker(store) is None
    with GcMarker(store) as marker:
        doc = read_marker(store)
        assert doc is not None and doc.expires - time.time() <= 60
        assert doc.process and doc.process["pid"] == os.getpid()
