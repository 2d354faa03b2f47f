"""Helpers for the adversarial sandbox tests: the sandbox fixtures of tests/run (a store
with the busybox image, one node per module; star-imported by the test modules) and the
real `dsec` script with a timeout and its peak RSS (wait4's ru_maxrss of that one process:
exact, no sampling)."""

from __future__ import annotations

import os
import resource
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.run.conftest import dsec_home, node, node_env, sandbox_data, store_url

__all__ = ["dsec_home", "node", "node_env", "sandbox_data", "store_url", "Ran",
           "dsec_measured"]


@dataclass
class Ran:
    returncode: int
    stdout: bytes
    stderr: bytes
    seconds: float
    max_rss: int  # bytes, the dsec process at its peak
    timed_out: bool


def dsec_measured(env: dict[str, str], *args: str, timeout: float = 120,
                  address_space: int | None = None) -> Ran:
    """Run the real `dsec` console script; kill it after `timeout` seconds. With
    `address_space`, the process cannot grow past that many bytes (a copy that would hold a
    whole file fails with a MemoryError instead of pressing on the machine)."""
    exe = Path(os.sys.executable).with_name("dsec")  # type: ignore[attr-defined]

    def limit() -> None:
        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        p = subprocess.Popen([str(exe), *args], stdout=out, stderr=err,
                             env={**os.environ, **env}, preexec_fn=limit)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            p.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        return Ran(p.returncode, out.read(), err.read(), seconds, usage.ru_maxrss * 1024,
                   killed.is_set())
