"""`RemoteNode`: the Node API (create, exec, cp, pause, snapshot, remove, list, gc) spoken to a
node's service over an SSH channel, with sandbox ids qualified by the node (``node1/abc123``).

A `Channel` is one ``dsec agent --stdio`` session: requests are multiplexed on it by id (a
reader thread hands each reply to its waiting caller), so one channel per node serves every
thread of a process. Failures are typed: the channel dying or a bounded wait running out is
`NodeUnreachableError` (retried, but only where repeating cannot do a thing twice: opening a
channel, and read-only requests); an error the node service returns is the same class as on the node
(`NotFoundError` exits 2 here as there); a command's exit code is a result, never an error.
Whatever a node sends is read through `protocol.Lines`: a line past its bound is a
`NodeCommandError` (not retried) and the connection is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

from ...backends.base import ExecResult, OutputCallback
from ...core.config import env, net_timeouts
from ...core.errors import ConfigError, DsecError, NodeUnreachableError, UsageError
from ...core.mux import InFlight
from ..options import CreateOptions
from ..state import SandboxRecord
from .errors import NodeCommandError
from .protocol import (
    PROTOCOL_VERSION,
    Lines,
    b64,
    check_size,
    decode,
    encode,
    error_from_wire,
    from_wire,
    to_wire,
    unb64,
)
from .ssh import SshTarget, classify, control_dir

log = logging.getLogger(__name__)

T = TypeVar("T")

#: read-only requests: safe to send again after a connection broke mid-request
IDEMPOTENT = frozenset({"hello", "info", "lookup", "describe", "get", "ps"})
RETRIES = 3
#: bytes asked for per read from a node (lines are cut from them by `protocol.Lines`)
READ_CHUNK = 1 << 16
#: ssh messages of a session kept to explain its failure: the last of these many reads
STDERR_KEPT = 20



def refuse_user(user: str | None) -> None:
    """A cluster node runs commands and file access as its sandbox's user: ``user=`` is
    refused."""
    if user is not None:
        raise UsageError("a user (for an exec or a file) can be given only on this node's "
                         "sandboxes",
                         hint="create the sandbox with the user instead")

class Attempts:
    """When a request to a node is tried again, for the thread and the asyncio client alike.

    A node that could not be reached is tried up to RETRIES times, with a doubling delay, but
    not past `budget` seconds: a silent node fails within about one connect + read timeout,
    retries included. A request whose connection broke after it was sent is sent again only
    when it is read-only (IDEMPOTENT): a create whose reply was lost is never resent."""

    def __init__(self, op: str, budget: float, now: Callable[[], float] = time.monotonic
                 ) -> None:
        self.op, self.budget, self._now = op, budget, now
        self._start, self._attempt, self._delay = now(), 0, 0.2

    def retry(self, *, sent: bool) -> float | None:
        """After an unreachable node: the delay before trying again, or None to give up.
        `sent`: the request may have reached the node."""
        self._attempt += 1
        if self._attempt >= RETRIES or (sent and self.op not in IDEMPOTENT):
            return None
        spent = self._now() - self._start
        # stop when one more attempt, as long as the average one, would go past the budget
        if not sent and spent * (self._attempt + 1) / self._attempt > self.budget:
            return None
        delay, self._delay = self._delay, self._delay * 2
        return delay


@dataclass(frozen=True, eq=False)
class NodeEntry:
    """One node of the user's config."""

    name: str
    target: SshTarget
    dsec: str = "dsec"  # the remote command that runs dsec
    labels: dict[str, str] = field(default_factory=dict)

    def remote_command(self) -> list[str]:
        return [self.dsec, "agent", "--stdio"]

    def resident_command(self) -> list[str]:
        return [self.dsec, "agent", "--resident"]

    def key(self) -> tuple[str, SshTarget, str]:
        """What identifies a connection (labels do not)."""
        return (self.name, self.target, self.dsec)


_EOF = object()


def session_failure(name: str, stderr: list[bytes], rc: int | None) -> DsecError:
    """Why a ``dsec agent --stdio`` session ended, from ssh's exit status and its last
    messages (for the thread and the asyncio channel alike)."""
    text = b"".join(stderr).decode(errors="replace")
    if rc == 127:
        text += "\ncommand not found"
    err = classify(name, text)
    return err if isinstance(err, DsecError) else NodeUnreachableError(str(err))


def event_of(msg: dict[str, Any]) -> tuple[str, bytes] | None:
    """A reply line that is an output event of the request: its stream and bytes."""
    if "event" not in msg:
        return None
    return str(msg["event"]), unb64(msg.get("data", ""))


def result_of(msg: dict[str, Any], name: str) -> Any:
    """A request's final reply: its result, or the node's error raised as on the node."""
    if msg.get("ok"):
        return msg.get("result")
    raise error_from_wire(msg.get("error") or {}, name)


def route(requests: InFlight[Any], line: bytes, name: str) -> None:
    """Hand one line of a node to the caller waiting for its request id (a `queue.Queue`
    or an `asyncio.Queue`: the thread and the asyncio channel alike); a line that is no
    message, or answers no waiting request, is dropped."""
    try:
        msg = decode(line)
    except ValueError:
        log.warning("%s: not a node service message: %r", name, line[:200])
        return
    rid = msg.get("id")
    q = requests.get(rid) if isinstance(rid, int) else None
    if q is not None:
        q.put_nowait(msg)


def no_answer(name: str, op: str, timeout: float | None) -> NodeUnreachableError:
    return NodeUnreachableError(f"{name}: no answer to {op} within {timeout:g}s")


# -- the resident node service: where its forwarded socket is, and starting it ----------------
def _memo(entry: NodeEntry) -> Path:
    """The file naming the node's resident service socket (on the node), for this entry."""
    tag = hashlib.sha256(entry.dsec.encode()).hexdigest()[:8]
    return control_dir() / f"{entry.target.control_path.name}-{tag}.agent"


def _local_end(entry: NodeEntry, remote: str) -> Path:
    """The local end of the forward to the node's socket ``remote`` (bound by the master)."""
    tag = hashlib.sha256(remote.encode()).hexdigest()[:8]
    return control_dir() / f"{entry.target.control_path.name}-{tag}.s"


def resident_socket(entry: NodeEntry) -> Path | None:
    """The forwarded socket of the node's resident service, as last set up (None: never)."""
    try:
        remote = _memo(entry).read_text().strip()
    except OSError:
        return None
    return _local_end(entry, remote) if remote else None


def start_resident(entry: NodeEntry, greet: float) -> Path | None:
    """Make sure the node's resident service runs (``dsec agent --resident`` over the
    master) and that the master forwards a local socket to it; that socket, or None when the
    node's dsec has no resident service (an older install)."""
    target = entry.target
    target.ensure_master(entry.name)
    command = entry.resident_command()
    with tempfile.TemporaryFile() as err:
        try:
            rc, out = _reply(target.command_argv(command), err, entry.name, greet)
        except subprocess.TimeoutExpired as e:
            raise NodeUnreachableError(
                f"{entry.name} ({target.address}): `{shlex.join(command)}` did not answer the "
                f"protocol greeting within {greet:g}s",
                hint="check the node with `dsec node check`; DSEC_READ_TIMEOUT sets the wait"
            ) from e
        err.seek(max(0, err.seek(0, os.SEEK_END) - 4000))
        text = err.read().decode(errors="replace")
    if rc == 2 and "--resident" in text:
        log.info("%s: the node's dsec has no resident service: a session per connection",
                 entry.name)
        return None
    if rc in (127, 255):
        raise classify(entry.name, text + ("\ncommand not found" if rc == 127 else ""))
    try:
        remote = str(json.loads(out)["socket"])
    except (ValueError, KeyError, TypeError):
        tail = "; ".join(text.strip().splitlines()[-3:]) or out[:200].decode(errors="replace")
        raise NodeCommandError(f"{entry.name} ({target.address}): `{shlex.join(command)}` "
                               f"failed (exit {rc}): {tail}",
                               hint="dsec node add --bootstrap installs a matching dsec") from None
    local = _local_end(entry, remote)
    target.forward(local, remote)
    memo = _memo(entry)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(remote + "\n")
    os.replace(tmp, memo)
    return local


def _reply(argv: list[str], err: IO[bytes], node: str, timeout: float) -> tuple[int, bytes]:
    """Run ``argv`` (a command on a node) with stderr to ``err``: its exit code and its
    output, one message (`check_size`). TimeoutExpired when it has not ended within
    ``timeout`` seconds (it is killed)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=err)
    late = threading.Event()

    def stop() -> None:
        late.set()
        proc.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    assert proc.stdout is not None
    out = bytearray()
    try:
        while chunk := proc.stdout.read1(READ_CHUNK):  # type: ignore[attr-defined]
            out += chunk
            check_size(node, len(out))
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if late.is_set():
        raise subprocess.TimeoutExpired(argv, timeout)
    return rc, bytes(out)


class Channel:
    """One node service connection: to the node's resident service through a socket
    forwarded over the node's SSH master (the default), or one ``dsec agent --stdio`` session
    over that master (``DSEC_NODE_AGENT=stdio``, and where the resident service cannot be
    used: a node whose dsec lacks it, or whose sshd forwards no sockets)."""

    def __init__(self, entry: NodeEntry, timeout: float) -> None:
        self.name = entry.name
        self.entry = entry
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._rfile: IO[bytes] | None = None
        self._wfile: IO[bytes] | None = None
        self._pending: InFlight[queue.Queue[Any]] = InFlight()
        self._wlock = threading.Lock()
        self._stderr: list[bytes] = []
        self._broken: DsecError | None = None  # the node broke the protocol (not retried)
        self.closed = False
        # the node service's first line is awaited no longer than one read timeout: a node whose
        # sshd answers but whose node service never speaks fails like a silent endpoint
        self.greet = min(timeout, net_timeouts().read)
        mode = env("DSEC_NODE_AGENT") or "resident"
        if mode not in ("resident", "stdio"):
            raise ConfigError(f"$DSEC_NODE_AGENT: {mode!r} must be resident or stdio")
        if mode == "stdio" or not self._open_resident():
            self._open_stdio()

    # -- transports -----------------------------------------------------------------------------
    def _greeting_error(self, command: list[str], cause: BaseException | None = None
                        ) -> NodeUnreachableError:
        err = NodeUnreachableError(
            f"{self.name} ({self.entry.target.address}): `{shlex.join(command)}` "
            f"did not answer the protocol greeting within {self.greet:g}s",
            hint="check the node with `dsec node check`; DSEC_READ_TIMEOUT sets the wait")
        err.__cause__ = cause
        return err

    def _say_hello(self, command: list[str]) -> None:
        try:
            self.hello = self.call("hello", {"version": PROTOCOL_VERSION}, timeout=self.greet)
        except NodeUnreachableError as e:
            self.close()  # no session left behind by a node that never greeted
            if "no answer to hello" not in e.message:
                raise
            raise self._greeting_error(command, e) from e
        except BaseException:
            self.close()
            raise

    def _open_stdio(self) -> None:
        target = self.entry.target
        target.ensure_master(self.name)
        self.proc = subprocess.Popen(target.command_argv(self.entry.remote_command()),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self._rfile, self._wfile = self.proc.stdout, self.proc.stdin
        self.closed = False
        threading.Thread(target=self._read, daemon=True, name=f"dsec-ch-{self.name}").start()
        threading.Thread(target=self._drain_err, daemon=True).start()
        self._say_hello(self.entry.remote_command())

    def _open_resident(self) -> bool:
        """Connect to the node's resident service, starting it (and the forward to it) when
        no answer comes; False when this node cannot serve one (use a stdio session)."""
        known = resident_socket(self.entry)
        for attempt in range(2):
            if attempt or known is None:
                known = start_resident(self.entry, self.greet)
                if known is None:
                    return False
            try:
                self._connect(known)
            except OSError:
                if attempt:
                    raise NodeUnreachableError(
                        f"{self.name}: the node service's forwarded socket refused the "
                        "connection") from None
                continue  # no forward (the master was restarted): set it up again
            try:
                self._say_hello(self.entry.resident_command())
                return True
            except NodeUnreachableError as e:
                if attempt == 0:
                    log.info("%s: resident node service did not answer (%s): restarting it",
                             self.name, e.message)
                    continue
                if "did not answer the protocol greeting" in e.message:
                    raise
                # started and answering on the node, yet unreachable through the forward
                log.warning("%s: the node's sshd does not forward to its node service (%s): "
                            "using a session per connection", self.name, e.message)
                return False
        return False

    def _connect(self, local: Path) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.greet)
            s.connect(str(local))
            s.settimeout(None)
        except OSError:
            s.close()
            raise
        self.sock = s
        self._rfile, self._wfile = s.makefile("rb"), s.makefile("wb")
        self.closed = False
        threading.Thread(target=self._read, daemon=True, name=f"dsec-ch-{self.name}").start()

    def _drain_err(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while chunk := self.proc.stderr.read1(READ_CHUNK):  # type: ignore[attr-defined]
            # kept: the last few reads
            self._stderr.append(chunk)
            del self._stderr[:-STDERR_KEPT]
            log.debug("%s node service: %s", self.name, chunk.decode(errors="replace").rstrip())

    def _read(self) -> None:
        rfile = self._rfile
        assert rfile is not None
        lines = Lines(self.name)
        try:
            while chunk := rfile.read1(READ_CHUNK):  # type: ignore[attr-defined]
                for line in lines.feed(chunk):
                    route(self._pending, line, self.name)
        except NodeCommandError as e:  # a line past the bound: nothing more is read
            self._broken = e
            self._drop()
        except (OSError, ValueError):  # the connection was closed under the reader
            pass
        if self._rfile is not rfile:
            return  # a connection given up while opening; the channel uses another now
        self.closed = True
        for q in self._pending.waiting():
            q.put(_EOF)

    def _drop(self) -> None:
        """Cut the connection at once: a node that broke the protocol is not waited for."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def failure(self) -> DsecError:
        """Why the connection ended: for a session, from ssh's exit status and messages."""
        if self._broken is not None:
            return self._broken
        if self.proc is None:
            return NodeUnreachableError(f"{self.name} ({self.entry.target.address}): the "
                                        "connection to the node service closed")
        try:
            rc = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
        return session_failure(self.name, self._stderr, rc)

    def call(self, op: str, args: dict[str, Any] | None = None, *,
             timeout: float | None = None, on_event: OutputCallback | None = None) -> Any:
        if self.closed:
            raise self.failure()
        q: queue.Queue[Any] = queue.Queue()
        rid = self._pending.add(q)
        assert rid is not None  # never closed: a channel reopens in place
        try:
            data = encode({"id": rid, "op": op, "args": args or {}})
            try:
                with self._wlock:
                    assert self._wfile is not None
                    self._wfile.write(data)
                    self._wfile.flush()
            except (BrokenPipeError, OSError):
                self.closed = True
                raise self.failure() from None
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    msg = q.get(timeout=left)
                except queue.Empty:
                    raise no_answer(self.name, op, timeout) from None
                if msg is _EOF:
                    raise self.failure()
                event = event_of(msg)
                if event is None:
                    return result_of(msg, self.name)
                if on_event is not None:
                    on_event(*event)
        finally:
            self._pending.done(rid)

    def close(self) -> None:
        self.closed = True
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the service drops us
            for f in (self._wfile, self._rfile):
                with contextlib.suppress(OSError):
                    f.close()  # type: ignore[union-attr]
            sock.close()
        if self.proc is not None and self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the node service finishes what is in flight and exits
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_channels: dict[tuple[str, SshTarget, str], Channel] = {}
_channels_lock = threading.Lock()


def channel(entry: NodeEntry, timeout: float) -> Channel:
    """The process's channel to a node, opened on first use and reopened when it died."""
    with _channels_lock:
        ch = _channels.get(entry.key())
        if ch is not None and not ch.closed:
            return ch
    ch = Channel(entry, timeout)  # outside the lock: opening one node must not stall others
    with _channels_lock:
        old = _channels.get(entry.key())
        if old is not None and not old.closed:
            ch.close()
            return old
        _channels[entry.key()] = ch
    return ch


def drop_channel(entry: NodeEntry) -> None:
    with _channels_lock:
        ch = _channels.pop(entry.key(), None)
    if ch is not None:
        ch.close()


def close_all() -> None:
    with _channels_lock:
        chans = list(_channels.values())
        _channels.clear()
    for ch in chans:
        ch.close()


@dataclass
class RemoteRecord:
    """A sandbox on a remote node: the node's own record, with a node-qualified ``id``."""

    id: str
    node: str
    record: SandboxRecord

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def backend(self) -> str:
        return self.record.backend

    @property
    def image(self) -> str:
        return self.record.image

    def public(self) -> dict[str, Any]:
        return {**self.record.public(), "id": self.id, "node": self.node}


def _same(answer: Any) -> Any:
    return answer


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to a node service: its op and arguments, its bound (None: the session's
    own), and how its answer becomes the result."""

    op: str
    args: dict[str, Any]
    shape: Callable[[Any], T]
    timeout: float | None = None


class NodeRequests:
    """The node protocol's requests for one node, decided once and I/O-free: each
    ``*_call`` method says what is sent and how the answer is shaped (ids qualified by the
    node). `RemoteNode` sends them from threads, `AsyncRemoteNode` from an event loop."""

    def __init__(self, entry: NodeEntry, timeout: float = 30.0) -> None:
        self.entry = entry
        self.name = entry.name
        self.timeout = timeout  # bound for opening and for read-only requests

    def _rec(self, doc: Any) -> RemoteRecord:
        rec = from_wire(SandboxRecord, doc)
        return RemoteRecord(f"{self.name}/{rec.id}", self.name, rec)

    @staticmethod
    def local_id(sid: str) -> str:
        return sid.rsplit("/", 1)[-1]

    def _on(self, op: str, sid: str, shape: Callable[[Any], T], **args: Any) -> Call[T]:
        """A request about sandbox ``sid``."""
        return Call(op, {"id": self.local_id(sid), **args}, shape)

    def _named(self, sid: str) -> Callable[[Any], dict[str, Any]]:
        """An answer whose ``id`` is the sandbox's, qualified by the node."""
        def shape(doc: Any) -> dict[str, Any]:
            doc = dict(doc)
            return {**doc, "id": f"{self.name}/{doc.get('id', self.local_id(sid))}"}

        return shape

    def _of_sandbox(self, sid: str) -> Callable[[Any], dict[str, Any]]:
        """An answer whose ``sandbox`` is the sandbox's, qualified by the node."""
        def shape(doc: Any) -> dict[str, Any]:
            out = dict(doc)
            out["sandbox"] = f"{self.name}/{out.get('sandbox', self.local_id(sid))}"
            return out

        return shape

    def info_call(self, image: str | None, timeout: float | None) -> Call[dict[str, Any]]:
        return Call("info", {"image": image}, dict, timeout or self.timeout)

    def create_call(self, image: str, opts: CreateOptions | None) -> Call[RemoteRecord]:
        return Call("create", {"image": image, "opts": to_wire(opts or CreateOptions())},
                    self._rec)

    def lookup_call(self, sid: str) -> Call[RemoteRecord]:
        return dataclasses.replace(self._on("lookup", sid, self._rec), timeout=self.timeout)

    def exec_call(self, sid: str, argv: list[str], env: dict[str, str] | None,
                  cwd: str | None, stdin: bytes | None, timeout: float | None, stream: bool,
                  capture_limit: int | None) -> Call[ExecResult]:
        """An exec; ``stdin`` whole (the protocol sends it in one message)."""
        return self._on("exec", sid, lambda r: from_wire(ExecResult, r), argv=list(argv),
                        env=env or {}, cwd=cwd, stdin=None if stdin is None else b64(stdin),
                        timeout=timeout, stream=stream, capture_limit=capture_limit)

    def put_call(self, sid: str, path: str, data: bytes, mode: int) -> Call[Any]:
        return self._on("put", sid, _same, path=path, data=b64(data), mode=mode)

    def get_call(self, sid: str, path: str) -> Call[tuple[bytes, int]]:
        return self._on("get", sid, lambda r: (unb64(r["data"]), int(r["mode"])), path=path)

    def describe_call(self, sid: str) -> Call[dict[str, Any]]:
        def shape(doc: Any) -> dict[str, Any]:
            return {**self._named(sid)(doc), "node": self.name}

        return dataclasses.replace(self._on("describe", sid, shape), timeout=self.timeout)

    def park_call(self, sid: str) -> Call[dict[str, Any]]:
        return self._on("park", sid, self._named(sid))

    def thaw_call(self, sid: str, prefetch: bool) -> Call[dict[str, Any]]:
        # prefetch only when asked: a node older than the option still thaws
        return self._on("thaw", sid, self._named(sid),
                        **({"prefetch": True} if prefetch else {}))

    def snapshot_call(self, sid: str, ref: str, push: str | None, replace: bool
                      ) -> Call[dict[str, Any]]:
        return self._on("snapshot", sid, self._of_sandbox(sid), ref=ref, push=push,
                        replace=replace)

    def fork_call(self, sid: str, n: int) -> Call[dict[str, Any]]:
        def shape(doc: Any) -> dict[str, Any]:
            out = self._of_sandbox(sid)(doc)
            out["copies"] = [self._rec(d) for d in out.get("copies", [])]
            return out

        return self._on("fork", sid, shape, n=n)

    def top_call(self, interval: float) -> Call[list[dict[str, Any]]]:
        def shape(rows: Any) -> list[dict[str, Any]]:
            return [{**r, "id": f"{self.name}/{r['id']}", "node": self.name} for r in rows]

        return Call("top", {"interval": interval}, shape, self.timeout + interval)


class RemoteNode(NodeRequests):
    """The node contract (`dsec_cli.run.contract.NodeAPI`) for one remote node: ids given to
    it may be ``NODE/ID`` or the node-local part."""

    def call(self, op: str, args: dict[str, Any] | None = None, *,
             timeout: float | None = None, on_event: OutputCallback | None = None) -> Any:
        attempts = Attempts(op, net_timeouts().total)
        while True:
            try:
                ch = channel(self.entry, self.timeout)
            except NodeUnreachableError:
                wait = attempts.retry(sent=False)
                if wait is None:
                    raise
                time.sleep(wait)
                continue
            try:
                return ch.call(op, args, timeout=timeout, on_event=on_event)
            except NodeUnreachableError:
                drop_channel(self.entry)
                wait = attempts.retry(sent=True)
                if wait is None:
                    raise
                time.sleep(wait)

    def send(self, c: Call[T], on_event: OutputCallback | None = None) -> T:
        return c.shape(self.call(c.op, c.args, timeout=c.timeout, on_event=on_event))

    # -- the Node API ---------------------------------------------------------------------------
    def info(self, image: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self.send(self.info_call(image, timeout))

    def create(self, image: str, opts: CreateOptions | None = None) -> RemoteRecord:
        return self.send(self.create_call(image, opts))

    def lookup(self, sid: str) -> RemoteRecord:
        return self.send(self.lookup_call(sid))

    def exec(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | Iterable[bytes] | None = None,
             timeout: float | None = None, on_output: OutputCallback | None = None,
             capture_limit: int | None = None, user: str | None = None) -> ExecResult:
        refuse_user(user)
        if stdin is not None and not isinstance(stdin, bytes | bytearray):
            stdin = b"".join(stdin)  # a chunk iterator (piped CLI stdin): sent whole
        return self.send(self.exec_call(
            sid, argv, env, cwd, stdin, timeout, on_output is not None, capture_limit),
            on_output)

    def put_file(self, sid: str, path: str, data: bytes, mode: int = 0o644,
                 user: str | None = None) -> None:
        """As the sandbox's user on its node (the node service's default)."""
        refuse_user(user)
        self.send(self.put_call(sid, path, data, mode))

    def get_file_with_mode(self, sid: str, path: str, user: str | None = None
                           ) -> tuple[bytes, int]:
        refuse_user(user)
        return self.send(self.get_call(sid, path))

    def get_file(self, sid: str, path: str, user: str | None = None) -> bytes:
        return self.get_file_with_mode(sid, path, user)[0]

    def remove(self, sid: str) -> RemoteRecord:
        return self.send(self._on("remove", sid, self._rec))

    def pause(self, sid: str) -> RemoteRecord:
        return self.send(self._on("pause", sid, self._rec))

    def resume(self, sid: str) -> RemoteRecord:
        return self.send(self._on("resume", sid, self._rec))

    def park(self, sid: str) -> dict[str, Any]:
        return self.send(self.park_call(sid))

    def thaw(self, sid: str, prefetch: bool = False) -> dict[str, Any]:
        return self.send(self.thaw_call(sid, prefetch))

    def park_export(self, sid: str) -> dict[str, Any]:
        return self.send(self._on("park_export", sid, dict))

    def park_incoming(self, sid: str) -> str:
        return self.send(self._on("park_incoming", sid, str))

    def park_import(self, exported: dict[str, Any]) -> RemoteRecord:
        return self._rec(self.call("park_import", {"exported": exported}))

    def top(self, interval: float = 0.0) -> list[dict[str, Any]]:
        return self.send(self.top_call(interval))

    def describe(self, sid: str) -> dict[str, Any]:
        return self.send(self.describe_call(sid))

    def snapshot(self, sid: str, ref: str, push: str | None = None, *,
                 replace: bool = False) -> dict[str, Any]:
        return self.send(self.snapshot_call(sid, ref, push, replace))

    def fork(self, sid: str, n: int) -> dict[str, Any]:
        return self.send(self.fork_call(sid, n))

    def grade(self, sid: str, grader: str, *, backend: str = "container",
              timeout: float | None = None) -> Any:
        """Score a sandbox of this node on the node itself (`run.grade.grade` there): its
        fork is made, run and removed there, also if this client goes away midway."""
        from ..grade import GradeResult

        res = from_wire(GradeResult, self.call("grade", {
            "id": self.local_id(sid), "grader": grader, "backend": backend,
            "timeout": timeout}))
        res.sandbox = f"{self.name}/{res.sandbox}"
        if res.fork:
            res.fork = f"{self.name}/{res.fork}"
        return res

    def start_task(self, sid: str) -> dict[str, Any]:
        out = dict(self.call("start_task", {"id": self.local_id(sid)}))
        out["sandbox"] = f"{self.name}/{out.get('sandbox', self.local_id(sid))}"
        return out

    def set_egress(self, sid: str, rules: list[str]) -> dict[str, Any]:
        return dict(self.call("egress", {"id": self.local_id(sid), "rules": list(rules)}))

    def fetch_stats(self, rec: RemoteRecord) -> dict[str, Any] | None:
        """A lazily fetched sandbox's fetch figures, as its node reports them (None for
        eagerly fetched ones, without asking the node)."""
        if rec.record.spec.get("fetch", "eager") == "eager":
            return None
        stats = self.describe(rec.id).get("fetch")
        return dict(stats) if stats is not None else None

    def sandboxes(self, timeout: float | None = None) -> list[RemoteRecord]:
        return [self._rec(d) for d in self.call("ps", timeout=timeout or self.timeout)]

    def gc(self, budget: int | None = None, dry_run: bool = False,
           timeout: float | None = None) -> dict[str, Any]:
        return dict(self.call("gc", {"budget": budget, "dry_run": dry_run}, timeout=timeout))
