"""The node service (`dsec agent`): the node side of the cluster, serving the JSON-lines node
protocol (protocol.py) against this node's sandboxes (dsec_cli.run.node.Node). Not to be
confused with the sandbox agent (dsec_cli/backends/sandbox_agent/), the exec server inside
each sandbox; the command keeps its `dsec agent` name for compatibility.

The CLI reaches it as ``ssh node dsec agent --stdio``: one node service process per client
connection, all of them sharing the node's state dir (its sqlite databases make concurrent
processes safe; admission.py keeps them from oversubscribing the node). Requests run on a
thread pool, so a slow create does not hold up an exec on the same connection. When the
client goes away (stdin closes) the node service finishes what is in flight and exits.
``--listen PATH`` serves the same protocol on a unix socket; ``--resident`` keeps one such
service per node environment running and says where (resident.py): the client reaches it
through a socket forwarded over its SSH master.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from ... import __version__ as _dsec_version
from ...core import validate
from ...core.errors import UsageError
from ...core.rundir import peer_uid
from ..density import host_facts
from ..fork import check_count, copy_options
from ..node import CreateOptions, Node, local_node
from .admission import Admission
from .protocol import (
    PROTOCOL_VERSION,
    b64,
    decode,
    encode,
    error_to_wire,
    from_wire,
    to_wire,
    unb64,
)

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]


class NodeService:
    """The request handlers: one instance per node state dir, shared by connections."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.admission = Admission(node)
        node.pools.admit = self.admission.admit_member

    # -- node facts -----------------------------------------------------------------------------
    def hello(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        version = args.get("version")
        if not isinstance(version, int) or version != PROTOCOL_VERSION:
            raise UsageError(f"client speaks node protocol {version!r}, this node speaks "
                             f"{PROTOCOL_VERSION}", hint="install the same dsec on both sides")
        return {"protocol": PROTOCOL_VERSION, "dsec": _dsec_version,
                "hostname": socket.gethostname(), "state_dir": str(self.node.root),
                "pid": os.getpid()}

    def info(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        image = args.get("image")
        return {**self.node.info(str(image) if image else None), "protocol": PROTOCOL_VERSION,
                "capacity": self.admission.capacity().to_dict(),
                "usage": self.admission.usage().to_dict(),
                "density": host_facts()}  # swap, KSM, controllers: docs/density.md

    # -- sandboxes ------------------------------------------------------------------------------
    def create(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        opts = from_wire(CreateOptions, args.get("opts") or {})
        opts.validate()  # bad input is refused before anything is reserved
        image = str(args["image"])
        # a warm pool member is already counted: taking it reserves nothing
        rec = self.node.take_pooled(image, opts)
        if rec is None:
            token = self.admission.reserve(opts.cpus, opts.memory, opts.cpu_class)
            try:
                rec = self.node.create(image, opts, from_pool=False, sid=token)
            finally:
                self.admission.release(token)
        return to_wire(rec)

    def exec(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        stream = bool(args.get("stream"))

        def on_output(kind: str, data: bytes) -> None:
            emit({"event": kind, "data": b64(data)})

        stdin = unb64(args["stdin"]) if args.get("stdin") is not None else None
        res = self.node.exec(str(args["id"]), list(args["argv"]), env=args.get("env") or {},
                             cwd=args.get("cwd"), stdin=stdin, timeout=args.get("timeout"),
                             on_output=on_output if stream else None,
                             capture_limit=validate.positive_int(args.get("capture_limit"),
                                                                  "capture_limit", minimum=0))
        if stream:  # the output went out as events already
            res = dataclasses.replace(res, stdout=b"", stderr=b"")
        return to_wire(res)

    def put(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        self.node.put_file(str(args["id"]), str(args["path"]), unb64(args["data"]),
                           int(args.get("mode", 0o644)))
        return {}

    def get(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        data, mode = self.node.get_file_with_mode(str(args["id"]), str(args["path"]))
        return {"data": b64(data), "mode": mode}

    def lookup(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return to_wire(self.node.lookup(str(args["id"])))

    def remove(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return to_wire(self.node.remove(str(args["id"])))

    def pause(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return to_wire(self.node.pause(str(args["id"])))

    def resume(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return to_wire(self.node.resume(str(args["id"])))

    def describe(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.node.describe(str(args["id"]))

    def snapshot(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.node.snapshot(str(args["id"]), str(args["ref"]), args.get("push"),
                                  replace=bool(args.get("replace", False)))

    def park(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.node.park(str(args["id"]))

    def thaw(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        prefetch = args.get("prefetch", False)
        if not isinstance(prefetch, bool):
            raise UsageError(f"invalid prefetch {prefetch!r}: true or false")
        return self.node.thaw(str(args["id"]), prefetch)

    def park_export(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.node.park_export(str(args["id"]))

    def park_incoming(self, args: dict[str, Any], emit: Emit) -> str:
        return self.node.park_incoming(str(args["id"]))

    def park_import(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        exported = args["exported"]
        if not isinstance(exported, dict):
            raise UsageError("park_import: exported must be an object")
        # the moved sandbox counts against this node's capacity as a create would
        rec = exported.get("record")
        spec = rec.get("spec") if isinstance(rec, dict) else None
        limits = spec.get("limits") if isinstance(spec, dict) else None
        lim = limits if isinstance(limits, dict) else {}

        def num(v: Any) -> Any:
            return v if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 \
                else None

        cls = lim.get("cpu_class") if lim.get("cpu_class") in ("latency", "batch", "idle") \
            else None
        token = self.admission.reserve(num(lim.get("cpus")), num(lim.get("memory")), cls)
        try:
            return to_wire(self.node.park_import(exported))
        finally:
            self.admission.release(token)

    def top(self, args: dict[str, Any], emit: Emit) -> list[dict[str, Any]]:
        return self.node.top(validate.positive_float(args.get("interval") or None, "interval")
                             or 0.0)

    def fork(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        n = check_count(args["n"])
        opts = copy_options(self.node.lookup(str(args["id"])))
        # the copies count against the node's capacity as n creates would
        token = self.admission.reserve(opts.cpus and opts.cpus * n,
                                       opts.memory and opts.memory * n)
        try:
            out = self.node.fork(str(args["id"]), n)
        finally:
            self.admission.release(token)
        return {**out, "copies": [to_wire(r) for r in out["copies"]]}

    def ps(self, args: dict[str, Any], emit: Emit) -> list[dict[str, Any]]:
        return [to_wire(r) for r in self.node.sandboxes()]

    def gc(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.node.gc(args.get("budget"), bool(args.get("dry_run")))

    # -- the grader plane (docs/grader.md): run on the sandbox's own node ----------------------
    def grade(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        from ..grade import grade

        timeout = validate.positive_float(args.get("timeout"), "--timeout")
        validate.image(str(args["grader"]), "--grader")
        return to_wire(grade(self.node, str(args["id"]), str(args["grader"]),
                             backend=str(args.get("backend") or "container"),
                             timeout=timeout))

    def start_task(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        from ..grade import start_task

        return start_task(self.node, str(args["id"]))

    def egress(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        from ..network import set_egress

        rules = args.get("rules")
        if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
            raise UsageError("egress rules must be a list of strings")
        return set_egress(self.node, str(args["id"]), rules)

    def job(self, args: dict[str, Any], emit: Emit) -> Any:
        """A job request (run/cluster/jobs.py): leases, rollouts, journaled execs, replay."""
        from .jobs import serve

        return serve(self.node, self.admission, args)

    OPS = ("hello", "info", "create", "exec", "put", "get", "lookup", "remove", "pause",
           "resume", "describe", "snapshot", "fork", "ps", "gc", "job", "park", "thaw",
           "top", "park_export", "park_incoming", "park_import", "grade", "start_task",
           "egress")

    def handle(self, msg: dict[str, Any], emit: Emit) -> Any:
        op = msg.get("op")
        if op not in self.OPS:
            raise UsageError(f"unknown node service request {op!r}")
        args = msg.get("args") or {}
        if not isinstance(args, dict):
            raise UsageError("request args must be an object")
        try:
            return getattr(self, str(op))(args, emit)
        except KeyError as e:
            raise UsageError(f"request {op!r} lacks argument {e}") from None


def serve_stream(service: NodeService, rfile: IO[bytes], wfile: IO[bytes],
                 workers: int = 32) -> None:
    """Serve one connection until its input closes; the first request must be hello."""
    lock = threading.Lock()
    greeted = threading.Event()

    def send(msg: dict[str, Any]) -> None:
        data = encode(msg)
        with lock:
            wfile.write(data)
            wfile.flush()

    def run(msg: dict[str, Any]) -> None:
        rid = msg.get("id")

        def emit(ev: dict[str, Any]) -> None:
            send({"id": rid, **ev})

        try:
            result = service.handle(msg, emit)
            send({"id": rid, "ok": True, "result": result})
        except Exception as e:  # every failure goes back to the client, typed
            if not isinstance(e, UsageError):
                log.warning("request %s failed: %s", msg.get("op"), e, exc_info=True)
            send({"id": rid, "ok": False, "error": error_to_wire(e)})

    with ThreadPoolExecutor(workers, thread_name_prefix="dsec-node-service") as pool:
        for line in rfile:
            if not line.strip():
                continue
            try:
                msg = decode(line)
            except ValueError as e:
                send({"id": None, "ok": False, "error": error_to_wire(
                    UsageError(f"malformed request: {e}"))})
                continue
            if not greeted.is_set():
                if msg.get("op") != "hello":
                    send({"id": msg.get("id"), "ok": False, "error": error_to_wire(
                        UsageError("the first request must be hello"))})
                    continue
                run(msg)  # inline: nothing else may run before the versions agree
                if msg.get("args", {}).get("version") == PROTOCOL_VERSION:
                    greeted.set()
                continue
            pool.submit(run, msg)


def serve_stdio(state_dir: str | None = None) -> None:
    """Serve on stdin/stdout. Fd 1 is moved aside first so that nothing a library prints can
    corrupt the protocol stream: stray output goes to stderr instead."""
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    service = NodeService(local_node(state_dir))
    serve_stream(service, sys.stdin.buffer, proto_out)


def serve_unix(path: str, state_dir: str | None = None, idle: float | None = None) -> None:
    """Serve on a unix socket (one thread per connection) until killed, or, with ``idle``,
    until no client has been connected for that many seconds; then the socket goes. Only
    clients of this user are served (SO_PEERCRED): the socket is the node."""
    service = NodeService(local_node(state_dir))
    p = Path(path)
    if p.is_socket():
        p.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o600)  # the socket is the node: only its owner may speak to it
    ours = p.stat().st_ino
    srv.listen(64)
    lock = threading.Lock()
    clients = 0
    last = time.monotonic()
    if idle is not None:
        srv.settimeout(min(idle, 5.0))

    def one(c: socket.socket) -> None:
        nonlocal clients, last
        try:
            with c, c.makefile("rb") as r, c.makefile("wb") as w:
                serve_stream(service, r, w)
        except OSError:  # the client went away mid-answer
            pass
        finally:
            with lock:
                clients -= 1
                last = time.monotonic()

    try:
        while True:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                with lock:
                    if idle is not None and not clients and time.monotonic() - last >= idle:
                        log.info("no client for %gs: exiting", idle)
                        return
                continue
            uid = peer_uid(conn)
            if uid != os.geteuid():  # the socket is 0600, and yet: never another user
                log.warning("refused a client running as uid %s", uid)
                conn.close()
                continue
            conn.settimeout(None)
            with lock:
                clients += 1
            threading.Thread(target=one, args=(conn,), daemon=True).start()
    finally:
        srv.close()
        try:
            if p.stat().st_ino == ours:  # a successor may have bound the path anew
                p.unlink()
        except OSError:
            pass
