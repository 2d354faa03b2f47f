"""A warm pool of fncall workers: call a Python function or run a command in a bubblewrap
sandbox in a few milliseconds.

Each worker is a bwrap sandbox (new user, pid, net, ipc and uts namespaces; every capability
dropped; no network unless asked; a read-only view of the host's Python and nothing else of
the host but /usr, /lib*, /bin, /sbin, /etc; a private /tmp), running a fork server
(_fnworker.py). Workers are started ahead of calls; a call forks inside a worker, so state
never leaks from one call to the next. Limits: a cgroup per worker (memory, pids, CPU) when
the node has cgroups, and RLIMIT_AS per call.

Results come back pickled from inside the sandbox; they are unpickled with a restricted
unpickler that builds only plain data (numbers, strings, bytes, lists, tuples, dicts, sets),
so a hostile callable cannot run code on the host through its return value.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import secrets
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from ..core.errors import BackendError, SandboxError, UsageError
from . import _cgroups, _rootfs, seccomp
from .base import ExecResult
from .fncall import bwrap_binary

_WORKER = Path(__file__).with_name("_fnworker.py")
_SAFE = {"set", "frozenset", "bytearray", "complex", "range", "slice"}


class FunctionCallError(SandboxError):
    """The callable raised inside the sandbox; carries its type name and traceback."""

    def __init__(self, type_name: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_traceback = remote_traceback


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE:
            return super().find_class(module, name)
        raise SandboxError(f"the sandboxed call returned a {module}.{name} object: only plain "
                           "data (numbers, strings, bytes, lists, tuples, dicts, sets) comes back")


def _loads(data: bytes) -> Any:
    return _PlainUnpickler(io.BytesIO(data)).load()


def _host_python_binds() -> list[str]:
    """Read-only binds giving the sandbox the host's Python and its import path."""
    paths = {"/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", sys.prefix, sys.base_prefix,
             str(_WORKER.parent)}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    binds: list[str] = []
    links: list[str] = []
    for p in sorted(paths, key=len):
        real = os.path.realpath(p)
        if not os.path.exists(real):
            continue
        if os.path.islink(p) and os.path.dirname(p) == "/":  # merged /usr: /bin -> usr/bin
            links += ["--symlink", os.readlink(p), p]
            p = real
        binds += ["--ro-bind", real, real]
        if real != p:
            binds += ["--ro-bind", real, p]
    return binds + links


class _Worker:
    def __init__(self, pool: FunctionPool) -> None:
        self.cgroup = None
        filt = seccomp.bpf_fd()
        argv = [bwrap_binary(), "--tmpfs", "/tmp", *_host_python_binds(), "--proc", "/proc",
                *_rootfs.bwrap_walls(filt), "--dev", "/dev", "--unshare-all", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--hostname", "fncall", "--chdir", "/tmp",
                "--clearenv",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "PYTHONPATH", os.pathsep.join(p for p in sys.path if p),
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        if pool.network == "host":
            argv.append("--share-net")
        argv += ["--", os.path.realpath(sys.executable), "-u", str(_WORKER)]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, pass_fds=(filt,))
        finally:
            os.close(filt)
        if pool.cgroup_parent and _cgroups.layout().mounts and os.geteuid() == 0:
            from .fncall import descendants

            cg = _cgroups.Cgroup(f"{pool.cgroup_parent}/{secrets.token_hex(5)}")
            cg.create(memory=pool.memory, pids=pool.pids, cpus=pool.cpus)
            for p in descendants(self.proc.pid):
                cg.add(p)
            self.cgroup = cg

    def request(self, req: dict[str, Any]) -> Any:
        data = pickle.dumps(req, protocol=4)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
            hdr = self.proc.stdout.read(4)
            if len(hdr) < 4:
                raise BackendError("the fncall worker exited")
            return self.proc.stdout.read(struct.unpack(">I", hdr)[0])
        except OSError as e:
            raise BackendError(f"the fncall worker failed: {e}") from e

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()


class FunctionPool:
    """``with FunctionPool(size=2) as pool: pool.call(fn, 1, 2); pool.run(["ls"])``."""

    def __init__(self, size: int = 2, *, memory: int | None = None, pids: int | None = None,
                 cpus: float | None = None, timeout: float | None = None,
                 network: Literal["none", "host"] = "none",
                 cgroup_parent: str | None = "dsec-fncall") -> None:
        if size < 1:
            raise UsageError(f"invalid pool size {size}: must be at least 1")
        self.memory, self.pids, self.cpus, self.timeout = memory, pids, cpus, timeout
        self.network, self.cgroup_parent = network, cgroup_parent
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        for _ in range(size):
            self._add()

    def _add(self) -> None:
        w = _Worker(self)
        with self._lock:
            self._all.append(w)
        self._idle.put(w)

    def _do(self, req: dict[str, Any]) -> Any:
        w = self._idle.get()
        try:
            raw = w.request(req)
        except BackendError:
            with self._lock:
                self._all.remove(w)
            w.close()
            threading.Thread(target=self._add, daemon=True).start()  # refill in background
            raise
        self._idle.put(w)
        reply = _loads(raw)
        kind = reply[0]
        if kind == "ok":
            return reply[1]
        if kind == "err":
            raise FunctionCallError(reply[1], reply[2], reply[3])
        if kind == "timeout":
            raise TimeoutError(f"the call did not finish within {req['timeout']}s")
        raise SandboxError(f"the call's process died (exit status {reply[1]}); "
                           "a memory or process limit may have stopped it")

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
             **kwargs: Any) -> Any:
        """Run fn(*args, **kwargs) in the sandbox and return its (plain-data) result."""
        return self._do({"kind": "call", "fn": fn, "args": args, "kwargs": kwargs,
                         "timeout": timeout or self.timeout, "memory": self.memory})

    def run(self, argv: Sequence[str], stdin: bytes | None = None, timeout: float | None = None,
            cwd: str | None = None) -> ExecResult:
        """Run a command in the sandbox (the host's /usr view) and return its result."""
        t0 = time.monotonic()
        try:
            code, out, err = self._do({"kind": "run", "argv": list(argv), "stdin": stdin,
                                       "cwd": cwd, "timeout": timeout or self.timeout,
                                       "memory": self.memory})
        except TimeoutError:
            return ExecResult(137, b"", b"", time.monotonic() - t0, timed_out=True)
        return ExecResult(code, out, err, time.monotonic() - t0)

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for w in workers:
            w.close()
        if self.cgroup_parent:
            _cgroups.Cgroup(self.cgroup_parent).remove_if_empty()

    def __enter__(self) -> FunctionPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
