"""A warm pool of fncall workers: call a Python function or run a command in a bubblewrap
sandbox in a few milliseconds.

Each worker is a bwrap sandbox (new user, pid, net, ipc and uts namespaces; every capability
dropped; no network unless asked; a private /tmp; a read-only root), running a fork server
(_fnworker.py). Of the host it sees, read-only, what it runs on and nothing else: /usr and
/lib*, the interpreter's own trees, the code its import path can import (not the other files
of a dir on it), and an /etc of the few public files an interpreter reads plus generated
users, groups and hosts (never the host's shadow, keys or configs). Workers are started
ahead of calls; a call forks inside a worker, so state never leaks from one call to the next.
Limits: a cgroup per worker (memory, pids, CPU) when the node has cgroups, and RLIMIT_AS per
call.

Results come back pickled from inside the sandbox; they are unpickled with a restricted
unpickler that builds only plain data (numbers, strings, bytes, lists, tuples, dicts, sets),
so a hostile callable cannot run code on the host through its return value.
"""

from __future__ import annotations

import importlib.machinery
import io
import os
import pickle
import queue
import secrets
import site
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


#: the host's system dirs, which the interpreter and commands run from
_SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
#: what of the host's /etc the interpreter and common commands read, none of it secret: the
#: loader's cache, the time zone, the links behind /usr/bin's alternatives, the public CA
#: certificates and OpenSSL's config, the netbase tables, Debian's sitecustomize
_HOST_ETC = ("ld.so.cache", "localtime", "alternatives", "ssl/certs", "ssl/openssl.cnf",
             "services", "protocols", "mime.types", "python{}.{}".format(*sys.version_info))
_MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())


def _etc_files() -> dict[str, bytes]:
    """The generated rest of /etc: users and groups root and nobody (and the caller's own ids,
    which an unprivileged bwrap maps), localhost, and name lookups through these files."""
    uid, gid = os.getuid(), os.getgid()
    passwd = ("root:x:0:0:root:/root:/bin/sh\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    group = "root:x:0:\nnogroup:x:65534:\n"
    if uid not in (0, 65534):
        passwd += f"user:x:{uid}:{gid}:user:/tmp:/bin/sh\n"
    if gid not in (0, 65534):
        group += f"user:x:{gid}:\n"
    return {"/etc/passwd": passwd.encode(), "/etc/group": group.encode(),
            "/etc/hosts": b"127.0.0.1\tlocalhost fncall\n::1\tlocalhost ip6-localhost\n",
            "/etc/nsswitch.conf": b"passwd: files\ngroup: files\nhosts: files dns\n"
                                  b"services: files\nprotocols: files\n"}


def _interpreter_dirs() -> set[str]:
    """The interpreter's own trees: its prefixes (stdlib, venv) and site dirs."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return {os.path.realpath(d) for d in dirs if os.path.isdir(d)}


def _importable(entry: str) -> list[str]:
    """What Python can import from a dir of the import path that is not the interpreter's
    own (a script's dir, a project root, a PYTHONPATH dir; maybe a home dir): its regular
    packages and top-level modules, never its other files (keys, dotfiles, data)."""
    out = []
    try:
        with os.scandir(entry) as it:
            for e in it:
                if not e.name.split(".", 1)[0].isidentifier():
                    continue
                if e.is_dir() and "." not in e.name:
                    if os.path.isfile(os.path.join(e.path, "__init__.py")):
                        out.append(e.path)
                elif e.name.endswith(_MODULE_SUFFIXES) and e.is_file():
                    out.append(e.path)
    except OSError:  # an unreadable dir: nothing of it can be imported here either
        return []
    return out


def _import_path() -> tuple[list[str], list[str]]:
    """The host's import path as a worker sees it: (the entries for PYTHONPATH, the paths to
    bind). An interpreter dir, or an entry below one, is bound whole; a zip on the path as it
    is; any other dir only with what it can import. The cwd ('') is not on it."""
    own = _interpreter_dirs()
    entries: list[str] = []
    paths = set(own)
    for entry in sys.path:
        if not entry or entry in entries or not os.path.exists(entry):
            continue
        entries.append(entry)
        real = os.path.realpath(entry)
        if any(real == d or real.startswith(d + "/") for d in own):
            if real != os.path.abspath(entry):
                paths.add(entry)  # reached through a symlink: bound there too
        elif os.path.isfile(real):
            paths.add(entry)
        elif os.path.isdir(real):
            paths.update(_importable(entry))
    return entries, sorted(paths)


def _ro_binds(paths: Sequence[str]) -> list[str]:
    """Read-only binds of host paths at the same place (and at their real path, where a
    symlink leads elsewhere), parents before children."""
    pairs = set()
    for p in paths:
        real = os.path.realpath(p)
        pairs.update({(real, real), (real, os.path.abspath(p))})
    args: list[str] = []
    same: list[str] = []  # bound at their own place: what is below them is already there
    for src, dest in sorted(pairs, key=lambda sd: (sd[1].count("/"), sd[1])):
        if src == dest:
            if any(dest.startswith(d + "/") for d in same):
                continue
            same.append(dest)
        args += ["--ro-bind", src, dest]
    return args


def _host_view(network: str) -> tuple[list[str], list[str], list[int]]:
    """What a worker sees of the host: its system dirs, the interpreter, the import path and
    the worker, read-only, and an /etc of `_HOST_ETC` and `_etc_files` (the host's DNS
    config too with the host's network). Returns bwrap arguments, the PYTHONPATH entries
    and the fds the arguments name (the caller passes, then closes them)."""
    links, system = [], []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d) and os.path.dirname(d) == "/":  # merged /usr: /bin -> usr/bin
            links += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            system.append(d)
    entries, paths = _import_path()
    args = _ro_binds([*system, *paths, str(_WORKER)])
    etc = [f"/etc/{name}" for name in _HOST_ETC]
    if network == "host":
        etc.append("/etc/resolv.conf")
    for path in etc:
        args += ["--ro-bind-try", path, path]
    fds = []
    for path, data in _etc_files().items():
        r, w = os.pipe()  # a few hundred bytes: the pipe holds them
        os.write(w, data)
        os.close(w)
        fds.append(r)
        args += ["--ro-bind-data", str(r), path]
    return args + links, entries, fds


class _Worker:
    def __init__(self, pool: FunctionPool) -> None:
        self.cgroup = None
        view, entries, fds = _host_view(pool.network)
        filt = seccomp.bpf_fd()
        fds.append(filt)
        # the root tmpfs is read-only once everything is mounted: a call leaves nothing in
        # it (an /etc/ld.so.preload, say) for the next call of this worker
        argv = [bwrap_binary(), "--tmpfs", "/tmp", *view, "--proc", "/proc",
                *_rootfs.bwrap_walls(filt), "--dev", "/dev", "--remount-ro", "/",
                "--unshare-all", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--hostname", "fncall", "--chdir", "/tmp",
                "--clearenv",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "PYTHONPATH", os.pathsep.join(entries),
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        if pool.network == "host":
            argv.append("--share-net")
        argv += ["--", os.path.realpath(sys.executable), "-u", str(_WORKER)]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
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
