"""Python client of the dsec-agent protocol (docs/agent.md).

One `AgentClient` owns one byte stream (a unix socket to a container's agent, or the host end
of a VM's virtio-serial port) and multiplexes requests over it: a reader thread routes each
incoming frame to the request with the same id, so several execs, puts and gets can be in
flight at once from different threads. Frames are read through `frames.FrameReader`, so
one bounded parse serves this client and the asyncio one.

`AgentClient.connect_unix` is the only way to open a socket connection, and it checks who
listens on the other end (SO_PEERCRED) before a byte is sent: code in a sandbox must not be
able to point the host at another sandbox's agent (docs/agent.md, "Who is on the other end").
"""

from __future__ import annotations

import contextlib
import errno as _errno
import logging
import os
import queue
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ...core.errors import NotFoundError, SandboxError, UsageError
from ...core.files import unix_address
from ...core.mux import InFlight
from ..base import ExecResult, OutputCallback, TreeSink, UserIds
from .frames import HEADER as _HDR
from .frames import AgentError, FrameReader, frame

log = logging.getLogger(__name__)

# frame types, client -> agent
T_EXEC, T_STDIN, T_PUT, T_GET, T_PING, T_SIGNAL, T_TREE, T_IDENTITY = 1, 2, 3, 4, 5, 6, 7, 8
T_PUT_AS, T_GET_AS = 9, 10
# frame types, agent -> client
T_STDOUT, T_STDERR, T_EXIT, T_RESULT, T_DATA = 16, 17, 18, 19, 20

EXEC_F_STDIN, EXEC_F_USER = 1, 2
PUT_F_APPEND, PUT_F_AT, PUT_F_SIZE = 1, 2, 4
CHUNK = 1 << 20
#: frames of one TREE transfer held on the host at most (each <= 1 MiB + 9): the reader
#: waits for the writer beyond this, so a copy's memory is bounded whatever its size
TREE_WINDOW = 8
#: after an exec's deadline, how long its agent has to report the command killed before the
#: host kills the agent itself (a frozen or silent agent must not hold the caller)
KILL_GRACE = 5.0
#: an exec ended by its deadline exits with 128 + SIGKILL, as the agent reports it
TIMED_OUT_CODE = 128 + signal.SIGKILL
_ENTRY = struct.Struct(">cIQ")
_PEERCRED = struct.Struct("3i")

#: decides whether the process (host pid) listening on an agent socket is the sandbox's own
PeerCheck = Callable[[int], bool]


def _s(value: str | bytes) -> bytes:
    b = value.encode() if isinstance(value, str) else value
    return struct.pack(">I", len(b)) + b


def _encode_exec(argv: list[str], env: dict[str, str], cwd: str | None, flags: int,
                 timeout: float | None, user: UserIds | None = None) -> bytes:
    if not argv:
        raise UsageError("exec needs a command")
    for part in [*argv, *env, *env.values(), cwd or ""]:
        if "\0" in part:
            raise UsageError("command, environment and working directory may not contain NUL")
    timeout_ms = 0 if not timeout else max(1, int(timeout * 1000))
    out = [struct.pack(">IIII", flags, timeout_ms, len(argv), len(env)), _s(cwd or "")]
    out += [_s(a) for a in argv]
    out += [_s(f"{k}={v}") for k, v in env.items()]
    if user is not None:
        out[0] = struct.pack(">IIII", flags | EXEC_F_USER, timeout_ms, len(argv), len(env))
        out.append(_user_ids(user))
    return b"".join(out)


def _user_ids(user: UserIds) -> bytes:
    """The `uid, gid, ngroups, groups` block of an exec's user flag and of PUT_AS/GET_AS."""
    ids = [user.uid, user.gid, len(user.groups), *user.groups]
    if not all(0 <= i < 2**32 - 1 for i in ids):
        raise UsageError(f"invalid user ids {ids}")
    return struct.pack(f">{len(ids)}I", *ids)


def file_request(kind: int, payload: bytes, user: UserIds | None) -> tuple[int, bytes]:
    """A PUT or GET as the agent itself (None), or as `user`: the same payload behind the
    user's ids, in a PUT_AS or GET_AS frame."""
    if user is None:
        return kind, payload
    return (T_PUT_AS if kind == T_PUT else T_GET_AS), _user_ids(user) + payload


def put_requests(path: str, data: bytes, mode: int, user: UserIds | None
                 ) -> Iterator[tuple[int, bytes]]:
    """The requests of a put_file, each a frame's kind and payload: the first creates or
    truncates the file, each further one appends the next CHUNK bytes (for the thread and
    the asyncio client alike)."""
    for off in range(0, max(len(data), 1), CHUNK):
        flags = PUT_F_APPEND if off else 0
        yield file_request(T_PUT, struct.pack(">II", mode, flags) + _s(path)
                           + data[off:off + CHUNK], user)


def file_reply(sink: list[bytes]) -> tuple[bytes, int]:
    """A get's content and mode from its data frames (the first holds the mode)."""
    if not sink or len(sink[0]) < 4:
        raise AgentError("the sandbox agent sent a malformed file reply")
    (mode,) = struct.unpack(">I", sink[0][:4])
    return b"".join(sink[1:]), mode


def check_file_result(code: int, msg: str, path: str, user: UserIds | None) -> None:
    """`_raise_for`, telling an agent that predates PUT_AS/GET_AS (ENOSYS) apart."""
    if code == _errno.ENOSYS and user is not None:
        raise SandboxError(f"cannot access {path} as user {user.uid}:{user.gid}: the "
                           "sandbox's agent predates file access as a user",
                           hint="recreate the sandbox, or pass user='root'")
    _raise_for(code, msg, path)


class _Request:
    """Frames for one request id, delivered by the reader thread. A bounded request (a file
    transfer) holds at most TREE_WINDOW frames: the reader waits for its consumer."""

    def __init__(self, bounded: bool = False) -> None:
        self.bounded = bounded
        self.frames: queue.Queue[tuple[int, bytes]] = queue.Queue(TREE_WINDOW if bounded else 0)


class ExecHandle:
    """A running exec: feed its stdin, signal it, wait for its result."""

    def __init__(self, client: AgentClient, rid: int, req: _Request,
                 on_output: OutputCallback | None, timeout: float | None = None) -> None:
        self._client, self.rid, self._req, self._on_output = client, rid, req, on_output
        self._started, self._timeout = time.monotonic(), timeout

    def write_stdin(self, data: bytes) -> None:
        for i in range(0, len(data), CHUNK):
            self._client._send(T_STDIN, self.rid, data[i:i + CHUNK])

    def close_stdin(self) -> None:
        self._client._send(T_STDIN, self.rid, b"")

    def signal(self, signum: int) -> None:
        self._client._send(T_SIGNAL, self.rid, struct.pack(">I", signum))

    def wait(self, capture_limit: int | None = None) -> ExecResult:
        """The result once the process exits. Output is kept in the result up to
        `capture_limit` bytes per stream (None: all of it); what is cut is flagged in
        `stdout_truncated` / `stderr_truncated` (and was still passed to `on_output`).

        With a timeout, the wait ends at the deadline on this host's clock whatever the agent
        does: the command is killed through the agent, or with the agent when it does not
        report it killed within KILL_GRACE (`ExecFrames.lapse`)."""
        fold = ExecFrames(self._started, capture_limit, self._timeout)
        try:
            while True:
                try:
                    kind, payload = self._req.frames.get(timeout=fold.left())
                except queue.Empty:
                    if fold.lapse():
                        self._client._kill_nowait(self.rid)
                        continue
                    self._client.kill_agent("an exec's deadline passed and the agent did not "
                                            f"report it killed within {KILL_GRACE:g}s")
                    return fold.timed_out()
                stream = ExecFrames.stream(kind)
                if stream is not None and self._on_output is not None:
                    self._on_output(stream, payload)
                result = fold.add(kind, payload)
                if result is not None:
                    return result
        finally:
            self._client._done(self.rid)


class ExecFrames:
    """One exec's frames folded into its result, for the thread and the asyncio client alike:
    output kept up to `capture_limit` bytes per stream (what is cut is flagged), the exit
    frame, and the two ways an exec ends without one (the agent's refusal, a lost link: a
    negative kind). With a timeout it also holds the exec's deadline, on the host's own
    clock: `left` is how long to wait for the next frame, `lapse` says what to do when that
    wait runs out."""

    def __init__(self, started: float, capture_limit: int | None,
                 timeout: float | None = None) -> None:
        self._started, self._limit = started, capture_limit
        self._deadline = started + timeout if timeout else None
        self.expired = False  # the deadline passed: the result is a timeout
        self._kept: dict[int, list[bytes]] = {T_STDOUT: [], T_STDERR: []}
        self._size = {T_STDOUT: 0, T_STDERR: 0}
        self._cut = {T_STDOUT: False, T_STDERR: False}

    def left(self) -> float | None:
        """Seconds to wait for the next frame (None: no deadline)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def lapse(self) -> bool:
        """The wait `left` allowed ran out. True at the deadline: kill the command through
        the agent, which gets KILL_GRACE more to report it; False when that grace is over
        too: the host must kill the agent and take `timed_out`."""
        if self.expired:
            return False
        self.expired = True
        self._deadline = time.monotonic() + KILL_GRACE
        return True

    def timed_out(self) -> ExecResult:
        """The result of an exec ended at its deadline without its agent's exit report."""
        return self._result(TIMED_OUT_CODE, timed_out=True)

    def _result(self, code: int, timed_out: bool) -> ExecResult:
        return ExecResult(exit_code=code, stdout=b"".join(self._kept[T_STDOUT]),
                          stderr=b"".join(self._kept[T_STDERR]),
                          duration=time.monotonic() - self._started,
                          timed_out=timed_out or self.expired,
                          stdout_truncated=self._cut[T_STDOUT],
                          stderr_truncated=self._cut[T_STDERR])

    @staticmethod
    def stream(kind: int) -> str | None:
        """"stdout" or "stderr" for an output frame (what `on_output` is told), else None."""
        return "stdout" if kind == T_STDOUT else "stderr" if kind == T_STDERR else None

    def add(self, kind: int, payload: bytes) -> ExecResult | None:
        """Take one frame: the result when it ends the exec, None while output goes on."""
        if kind == T_STDOUT or kind == T_STDERR:
            room = len(payload) if self._limit is None else self._limit - self._size[kind]
            if room < len(payload):
                self._cut[kind] = True
                payload = payload[:max(room, 0)]
            if payload:
                self._kept[kind].append(payload)
                self._size[kind] += len(payload)
        elif kind == T_EXIT:
            if len(payload) < 8:
                raise AgentError("the sandbox agent sent a malformed exit report")
            code, flags = struct.unpack(">iI", payload[:8])
            return self._result(code, timed_out=bool(flags & 1))
        elif kind == T_RESULT:
            code, msg = _result(payload)
            raise SandboxError(f"exec failed in the sandbox: {msg or os.strerror(code)}")
        elif kind < 0:
            if self.expired:  # past the deadline: a closed connection's execs are killed
                return self.timed_out()
            raise AgentError(f"lost the connection to the sandbox agent: {payload.decode()}")
        return None


def _feed(h: ExecHandle, blocks: Iterable[bytes]) -> None:
    try:
        for block in blocks:
            h.write_stdin(block)
        h.close_stdin()
    except (AgentError, OSError):
        pass  # the exec (or the connection) is gone: nothing left to feed


def _result(payload: bytes) -> tuple[int, str]:
    if len(payload) < 4:
        raise AgentError("the sandbox agent sent a malformed result")
    (code,) = struct.unpack(">i", payload[:4])
    return code, payload[4:].decode(errors="replace")


def _raise_for(code: int, msg: str, path: str) -> None:
    """The error of a failed file request; it carries the agent's errno and the path."""
    if code == 0:
        return
    err: SandboxError | UsageError
    if code in (_errno.ENOENT, _errno.ENOTDIR):
        err = NotFoundError(f"no such file in the sandbox: {path}")
    elif code in (_errno.EISDIR, _errno.EINVAL, _errno.EACCES, _errno.EPERM, _errno.EROFS,
                  _errno.ENXIO, _errno.ELOOP, _errno.ENAMETOOLONG):
        err = UsageError(f"cannot access {path} in the sandbox: {msg}")
    else:
        err = SandboxError(f"file transfer failed in the sandbox: {msg}")
    err.errno, err.filename = code, path
    raise err


def check_peer(sock: socket.socket, peer: Callable[[int], bool], what: str, path: object
               ) -> int:
    """Refuse (and close) a connected agent socket whose listener ``peer`` does not accept:
    SO_PEERCRED names the process that bound it, which a sandbox cannot fake. Returns a
    pidfd of that accepted listener (the agent), by which the host can kill it when it stops
    answering, whatever pid it leaves behind."""
    pid, _, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    pidfd = -1
    with contextlib.suppress(OSError):
        if pid > 0:
            pidfd = os.pidfd_open(pid)  # before the check: the check then names this process
    if pid <= 0 or pidfd < 0 or not peer(pid):
        sock.close()
        if pidfd >= 0:
            os.close(pidfd)
        raise AgentError(f"refusing the agent socket of {what} at {path}: it is served by "
                         f"process {pid}, which is not {what}'s agent (was the socket "
                         "replaced from inside a sandbox?)")
    return pidfd


def kill_listener(pidfd: int, what: str, why: str) -> None:
    """SIGKILL the agent `check_peer` accepted (its sandbox's process or QEMU): the host's
    last word to an agent that no longer answers. Its commands die with it."""
    log.warning("%s: %s: killing its agent", what, why)
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


class AgentClient:
    """A multiplexed connection to one dsec-agent. `what` names its sandbox in errors;
    `agent` is a pidfd of the agent (from `check_peer`), owned by the client."""

    def __init__(self, sock: socket.socket, what: str = "the sandbox", agent: int = -1
                 ) -> None:
        self._sock, self.what, self._agent = sock, what, agent
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: InFlight[_Request] = InFlight()
        self._reader = threading.Thread(target=self._read_loop, name="dsec-agent-reader",
                                        daemon=True)
        self._reader.start()

    # -- connecting ----------------------------------------------------------------------------
    @classmethod
    def connect_unix(cls, path: str | Path, *, peer: PeerCheck, what: str = "the sandbox",
                     timeout: float = 10.0) -> AgentClient:
        """Connect to an agent listening on a unix socket (any path length), and refuse the
        connection unless `peer(pid)` accepts the listening process (SO_PEERCRED: the pid
        of the process that called listen(), in this process's pid namespace)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(path) as target:
                sock.settimeout(timeout)
                sock.connect(target)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            raise AgentError(f"cannot connect to the sandbox agent at {path}: {e.strerror or e}") \
                from e
        return cls(sock, what, check_peer(sock, peer, what, path))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            agent, self._agent = self._agent, -1
        if agent >= 0:
            os.close(agent)

    def kill_agent(self, why: str) -> None:
        """Kill the agent (it stopped answering) and drop the connection."""
        with self._lock:
            agent = self._agent
        if agent >= 0:
            kill_listener(agent, self.what, why)
        self.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> str | None:
        """Why the connection ended; None while it is open."""
        return self._pending.closed

    def ids_from(self, rid: int) -> None:
        """Number this connection's next requests from ``rid`` on."""
        self._pending.start_at(rid)

    # -- plumbing ------------------------------------------------------------------------------
    def _open(self, bounded: bool = False) -> tuple[int, _Request]:
        req = _Request(bounded)
        rid = self._pending.add(req)
        if rid is None:
            raise AgentError("the sandbox agent connection is closed: "
                             f"{self._pending.closed}")
        return rid, req

    def _done(self, rid: int) -> None:
        self._pending.done(rid)

    def _send(self, kind: int, rid: int, payload: bytes) -> None:
        data = frame(kind, rid, payload)
        try:
            with self._wlock:
                self._sock.sendall(data)
        except OSError as e:
            raise AgentError(f"lost the connection to the sandbox agent: {e}") from e

    def _kill_nowait(self, rid: int) -> None:
        """SIGKILL an exec through the agent without waiting on it: an agent that reads
        nothing cannot hold the caller (a frame that does not fit now is not sent, and a
        part of one breaks the stream: then the agent is killed)."""
        data = _HDR.pack(9, T_SIGNAL, rid) + struct.pack(">I", signal.SIGKILL)
        if not self._wlock.acquire(timeout=1.0):
            return  # another sender is stuck on the agent: the grace decides
        try:
            sent = self._sock.send(data, socket.MSG_DONTWAIT)
        except OSError:
            return
        finally:
            self._wlock.release()
        if 0 < sent < len(data):
            self.kill_agent("its channel is full")

    def _read_loop(self) -> None:
        reason = "closed"
        frames = FrameReader(self.what)
        buf = memoryview(bytearray(CHUNK))
        try:
            while True:
                n = self._sock.recv_into(buf)
                if not n:
                    raise EOFError("the agent closed the connection")
                for kind, rid, payload in frames.feed(buf[:n]):
                    req = self._pending.get(rid)
                    if req is not None:
                        self._deliver(rid, req, (kind, payload))
        except AgentError as e:  # a frame past the bound: nothing more is read from it
            reason = e.message
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        except (OSError, EOFError) as e:
            reason = str(e) or type(e).__name__
        for req in self._pending.close(reason):
            req.frames.put((-1, reason.encode()))

    def _deliver(self, rid: int, req: _Request, frame: tuple[int, bytes]) -> None:
        if not req.bounded:
            req.frames.put(frame)
            return
        while True:  # wait for the consumer, unless it gave up on the request
            try:
                req.frames.put(frame, timeout=0.5)
                return
            except queue.Full:
                if self._pending.get(rid) is not req:
                    return

    def _wait_result(self, rid: int, req: _Request,
                     sink: list[bytes] | None = None) -> tuple[int, str]:
        try:
            while True:
                kind, payload = req.frames.get()
                if kind == T_RESULT:
                    return _result(payload)
                if kind == T_DATA and sink is not None:
                    sink.append(payload)
                elif kind < 0:
                    raise AgentError("lost the connection to the sandbox agent: "
                                     f"{payload.decode()}")
        finally:
            self._done(rid)

    # -- requests ------------------------------------------------------------------------------
    def ping(self) -> str:
        rid, req = self._open()
        self._send(T_PING, rid, b"")
        code, msg = self._wait_result(rid, req)
        return msg

    def identity(self, hostname: str, machine_id: str, seed: bytes) -> None:
        """Give a guest restored from a snapshot its own hostname, machine id (where the image
        has /etc/machine-id) and a CRNG reseeded from ``seed`` (32–512 host random bytes),
        done by the agent itself (docs/agent.md)."""
        host, mid = hostname.encode(), machine_id.encode()
        rid, req = self._open()
        self._send(T_IDENTITY, rid, struct.pack(">I", len(host)) + host
                   + struct.pack(">I", len(mid)) + mid + seed)
        code, msg = self._wait_result(rid, req)
        if code:
            raise AgentError(f"setting the sandbox's identity failed: {msg}")

    def start_exec(self, argv: list[str], env: dict[str, str] | None = None,
                   cwd: str | None = None, timeout: float | None = None, stdin: bool = False,
                   on_output: OutputCallback | None = None,
                   user: UserIds | None = None) -> ExecHandle:
        payload = _encode_exec(list(argv), dict(env or {}), cwd,
                               EXEC_F_STDIN if stdin else 0, timeout, user)
        rid, req = self._open()
        handle = ExecHandle(self, rid, req, on_output, timeout)
        self._send(T_EXEC, rid, payload)
        return handle

    def exec(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | Iterable[bytes] | None = None, timeout: float | None = None,
             on_output: OutputCallback | None = None,
             capture_limit: int | None = None, user: UserIds | None = None) -> ExecResult:
        h = self.start_exec(argv, env, cwd, timeout, stdin=stdin is not None, on_output=on_output,
                            user=user)
        if isinstance(stdin, bytes | bytearray):
            if stdin:
                h.write_stdin(bytes(stdin))
            h.close_stdin()
        elif stdin is not None:
            # a stream (e.g. the CLI's own stdin) is fed from a thread, so the result comes
            # back when the process exits even if the stream never ends
            threading.Thread(target=_feed, args=(h, stdin), daemon=True).start()
        return h.wait(capture_limit)

    def put_file(self, path: str, data: bytes, mode: int = 0o644,
                 user: UserIds | None = None) -> None:
        """Create or truncate the file (and its missing parents) and write `data`: as the
        agent (root), or with `user`'s ids, so permissions apply and what is made is theirs."""
        for kind, payload in put_requests(path, data, mode, user):
            rid, req = self._open()
            self._send(kind, rid, payload)
            code, msg = self._wait_result(rid, req)
            check_file_result(code, msg, path, user)

    def put_stream(self, path: str, src: BinaryIO, mode: int = 0o644) -> int:
        """Write a host file into the sandbox in 1 MiB frames, sending only its data extents
        (holes stay holes). Returns the file's size."""
        fd = src.fileno()
        size = os.fstat(fd).st_size
        self._put(path, struct.pack(">II", mode, 0) + _s(path))  # create / truncate
        for off, n in _extents(fd, size):
            while n > 0:
                block = os.pread(fd, min(n, CHUNK), off)
                if not block:
                    break
                self._put(path, struct.pack(">II", mode, PUT_F_AT) + _s(path)
                          + struct.pack(">Q", off) + block)
                off, n = off + len(block), n - len(block)
        self._put(path, struct.pack(">II", mode, PUT_F_SIZE) + _s(path) + struct.pack(">Q", size))
        return size

    def _put(self, path: str, payload: bytes) -> None:
        rid, req = self._open()
        self._send(T_PUT, rid, payload)
        code, msg = self._wait_result(rid, req)
        _raise_for(code, msg, path)

    def get_tree(self, path: str, sink: TreeSink) -> None:
        """Copy a file, symlink or directory out of the sandbox into `sink`, streamed: at most
        TREE_WINDOW frames are held here, holes are never sent."""
        rid, req = self._open(bounded=True)
        try:
            self._send(T_TREE, rid, path.encode())
            while True:
                kind, payload = req.frames.get()
                if kind == T_DATA:
                    _tree_record(payload, sink)
                elif kind == T_RESULT:
                    code, msg = _result(payload)
                    if code in (_errno.EINVAL, _errno.ELOOP, _errno.ENAMETOOLONG):
                        raise UsageError(f"cannot copy {msg}")  # msg names the path
                    _raise_for(code, msg, path)
                    return
                elif kind < 0:
                    raise AgentError("lost the connection to the sandbox agent: "
                                     f"{payload.decode()}")
        finally:
            self._done(rid)

    def get_file_with_mode(self, path: str, user: UserIds | None = None
                           ) -> tuple[bytes, int]:
        """A regular file's content and mode: read as the agent, or with `user`'s ids."""
        rid, req = self._open()
        kind, payload = file_request(T_GET, path.encode(), user)
        self._send(kind, rid, payload)
        sink: list[bytes] = []
        code, msg = self._wait_result(rid, req, sink)
        check_file_result(code, msg, path, user)
        return file_reply(sink)

    def get_file(self, path: str, user: UserIds | None = None) -> bytes:
        return self.get_file_with_mode(path, user)[0]


def _tree_record(payload: bytes, sink: TreeSink) -> None:
    """One DATA record of a TREE reply: an entry ('E') or file content at an offset ('C')."""
    if payload[:1] == b"C" and len(payload) >= 9:
        (off,) = struct.unpack(">Q", payload[1:9])
        sink.chunk(off, memoryview(payload)[9:])
        return
    if payload[:1] != b"E" or len(payload) < 22:
        raise AgentError("the sandbox agent sent a malformed file record")
    kind, mode, size = _ENTRY.unpack(payload[1:14])
    (rl,) = struct.unpack(">I", payload[14:18])
    rel = payload[18:18 + rl]
    (tl,) = struct.unpack(">I", payload[18 + rl:22 + rl])
    target = payload[22 + rl:22 + rl + tl]
    if len(rel) != rl or len(target) != tl:
        raise AgentError("the sandbox agent sent a malformed file record")
    sink.entry(kind.decode(errors="replace"), mode, size, rel, target)


def _extents(fd: int, size: int) -> Iterable[tuple[int, int]]:
    """(offset, length) of the data in a file, skipping holes where the filesystem says."""
    off = 0
    while off < size:
        try:
            data = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == _errno.ENXIO:
                return
            data = off  # no SEEK_DATA: everything is data
        if data >= size:
            return
        try:
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        except OSError:
            hole = size
        yield data, hole - data
        off = hole
