"""The warm fncall pool: callables and commands in bwrap workers over the host's Python."""

from __future__ import annotations

import os

import pytest

from dsec_cli.backends.fnpool import FunctionCallError, FunctionPool
from dsec_cli.core.errors import SandboxError

from . import fnfuncs


@pytest.fixture(scope="module")
def pool() -> object:
    with FunctionPool(2, memory=256 << 20, pids=32, cgroup_parent=f"dsec-test-{os.getpid()}") as p:
        yield p


def test_call_returns_plain_data(pool: FunctionPool) -> None:
    assert pool.call(fnfuncs.add, 2, 3) == 5
    assert pool.call(fnfuncs.add, [1], b=[2]) == [1, 2]


def test_call_sees_no_host_files_or_network(pool: FunctionPool) -> None:
    root = pool.call(fnfuncs.listdir, "/")
    assert "home" not in root and "var" not in root
    assert pool.call(fnfuncs.listdir, "/root") in ([], [".pyenv"])  # only the Python view
    with pytest.raises(FunctionCallError, match="OSError"):
        pool.call(fnfuncs.connect, "1.1.1.1", 80)


def test_errors_limits_and_isolation_between_calls(pool: FunctionPool) -> None:
    with pytest.raises(FunctionCallError, match="ValueError: boom"):
        pool.call(fnfuncs.boom)
    with pytest.raises(FunctionCallError, match="MemoryError"):
        pool.call(fnfuncs.hog, 512 << 20)
    with pytest.raises(TimeoutError):
        pool.call(fnfuncs.sleep, 30, timeout=0.3)
    pool.call(fnfuncs.set_global, 42)
    assert pool.call(fnfuncs.get_global) is None  # every call is a fresh fork
    with pytest.raises(SandboxError, match="plain data"):
        pool.call(fnfuncs.returns_object)


def test_run_command(pool: FunctionPool) -> None:
    r = pool.run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"in")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"in", b"err\n")
    r = pool.run(["sleep", "30"], timeout=0.3)
    assert r.timed_out
