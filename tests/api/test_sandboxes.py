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
    """kill -9 of a creating process at several points (after 1..4 finished creates, then
    0..300 ms into the next): ps reconciles, listing every finished create as running and
    nothing of an aborted one, and removal leaves nothing behind."""
    from dsec_cli.run.node import Node

    code = ("import sys; from dsec_cli.api.sandboxes import Sandbox\n"
            "for i in range(100): Sandbox.create(sys.argv[1]); print(i, flush=True)\n")
    n = Node(node_env["DSEC_STATE_DIR"])
    assert n.sandboxes() == []
    finished = 0
    for done, delay in [(1, 0.0), (2, 0.05), (1, 0.15), (3, 0.3)]:
        p = subprocess.Popen([sys.executable, "-c", code, IMAGE], stdout=subprocess.PIPE)
        assert p.stdout is not None
        for _ in range(done):
            assert p.stdout.readline().strip(), "the creating process ended early"
        time.sleep(delay)  # into the next create, a different step each round
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        finished += done + len(p.stdout.read().split())  # lines printed before the kill
    listed = n.sandboxes()  # reconciles: aborted creates are gone, finished ones are listed
    # every finished create is there, and at most one per round besides (completed, not
    # yet printed when the kill came)
    assert finished <= len(listed) <= finished + 4, (finished, listed)
    assert {r.status for r in listed} == {"running"}
    for r in listed:
        n.remove(r.id)
    assert n.sandboxes() == []
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_dead_sandbox_is_detected(node_env: dict[str, str]) -> None:
    s = Sandbox.create(IMAGE)
    pid = s.node.lookup(s.id).handle["pid"]
    os.kill(pid, signal.SIGKILL)
    from dsec_cli.backends._rootfs import alive
    from dsec_cli.run.node import Node

    deadline = time.monotonic() + 60
    while alive(pid, None) and time.monotonic() < deadline:  # the kill is asynchronous
        time.sleep(0.01)
    assert not alive(pid, None)

    n = Node(node_env["DSEC_STATE_DIR"])
    assert {r.id: r.status for r in n.sandboxes()}[s.id] == "dead"
    n.gc()
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_hundred_concurrent_sandboxes(node_env: dict[str, str]) -> None:
    """100 sandboxes alive at once, each with its exec; the SDK adds no thread per sandbox
    (counted while all 100 live), and everything is gone afterwards."""
    before = threading.active_count()
    counts: list[int] = []
    all_alive = threading.Barrier(100, action=lambda: counts.append(threading.active_count()))

    def one(i: int) -> bytes:
        with Sandbox.create(IMAGE, memory="32M", pids=16) as s:
            all_alive.wait(300)
            return s.exec(f"echo {i}").stdout

    with ThreadPoolExecutor(max_workers=100) as pool:
        out = list(pool.map(one, range(100)))
    assert out == [f"{i}\n".encode() for i in range(100)]
    # the pool's 100 workers, and fewer than 50 others, while every sandbox was alive
    assert len(counts) == 1 and counts[0] - 100 - before < 50, (counts, before)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}
