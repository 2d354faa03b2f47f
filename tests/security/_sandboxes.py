"""Helpers for the adversarial sandbox tests: the sandbox fixtures of tests/run (a store
with the busybox image, one node per module; star-imported by the test modules) and the
real `dsec` script with a timeout and its peak RSS (the ru_maxrss of that one process, taken
by a small launcher: exact, no sampling)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.run.conftest import dsec_home, node, node_env, sandbox_data, store_url

__all__ = ["dsec_home", "node", "node_env", "sandbox_data", "store_url", "Ran",
           "dsec_measured", "run_measured"]


@dataclass
class Ran:
    returncode: int
    stdout: bytes
    stderr: bytes
    seconds: float
    max_rss: int  # bytes, the dsec process at its peak
    timed_out: bool


#: A small launcher between pytest and dsec: a child forked from pytest itself would start
#: with pytest's pages resident, and ru_maxrss keeps that peak across exec. The launcher is
#: small when it forks, so RUSAGE_CHILDREN's peak is dsec's own.
_LAUNCHER = """
import os, resource, subprocess, sys
limit, report = int(sys.argv[1]), sys.argv[2]
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
rc = subprocess.call(sys.argv[3:])
with open(report, "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(rc)
"""


def dsec_measured(env: dict[str, str], *args: str, timeout: float = 120,
                  address_space: int | None = None) -> Ran:
    """Run the real `dsec` console script; kill it after `timeout` seconds. With
    `address_space`, the process cannot grow past that many bytes (a copy that would hold a
    whole file fails with a MemoryError instead of pressing on the machine)."""
    exe = Path(os.sys.executable).with_name("dsec")  # type: ignore[attr-defined]
    return run_measured([str(exe), *args], env, timeout=timeout, address_space=address_space)


def run_measured(argv: list[str], env: dict[str, str], *, timeout: float = 120,
                 address_space: int | None = None) -> Ran:
    """`dsec_measured` for any command (a Python snippet driving the SDK, say)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rss"
        t0 = time.monotonic()
        p = subprocess.Popen([os.sys.executable, "-S", "-c", _LAUNCHER,  # type: ignore[attr-defined]
                              str(address_space or 0), str(report), *argv],
                             stdout=out, stderr=err, env={**os.environ, **env},
                             start_new_session=True)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            os.killpg(p.pid, 9)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            p.wait()
        finally:
            timer.cancel()
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        rss = int(report.read_text()) if report.exists() else 0
        return Ran(p.returncode, out.read(), err.read(), seconds, rss, killed.is_set())
