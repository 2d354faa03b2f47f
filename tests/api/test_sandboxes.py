"""Crash recovery, dead sandboxes and 100 concurrent sandboxes, on real runc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dsec_cli.api.sandboxes import Sandbox

from .conftest import IMAGE, leaks


def test_kill_during_create_then_reconcile(node_env: dict[str, str]) -> None:
    """kill -9 of a creating process at several points: ps/gc leave nothing behind."""
    code = ("import sys; from dsec_cli.api.sandboxes import Sandbox\n"
            "for i in range(100): Sandbox.create(sys.argv[1]); print(i, flush=True)\n")
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", code, IMAGE], stdout=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.readline()  # at least one create done, the next one in flight
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    from dsec_cli.run.node import Node

    n = Node(node_env["DSEC_STATE_DIR"])
    n.sandboxes()  # reconciles: aborted creates are gone, finished ones are listed
    for r in n.db.all():
        assert r.status == "running"
        n.remove(r.id)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_dead_sandbox_is_detected(node_env: dict[str, str]) -> None:
    s = Sandbox.create(IMAGE)
    pid = s.node.lookup(s.id).handle["pid"]
    os.kill(pid, signal.SIGKILL)
    from dsec_cli.backends._rootfs import alive
    from dsec_cli.run.node import Node

    while alive(pid, None):  # the kill is delivered asynchronously
        time.sleep(0.01)

    n = Node(node_env["DSEC_STATE_DIR"])
    assert {r.id: r.status for r in n.sandboxes()}[s.id] == "dead"
    n.gc()
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_hundred_concurrent_sandboxes(node_env: dict[str, str]) -> None:
    def one(i: int) -> bytes:
        with Sandbox.create(IMAGE, memory="32M", pids=16) as s:
            return s.exec(f"echo {i}").stdout

    with ThreadPoolExecutor(max_workers=100) as pool:
        out = list(pool.map(one, range(100)))
    assert out == [f"{i}\n".encode() for i in range(100)]
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}
    assert threading.active_count() < 50
