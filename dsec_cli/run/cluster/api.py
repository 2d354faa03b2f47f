"""Cluster operations for the CLI and SDK: route node-qualified sandbox ids, place new
sandboxes (``--node auto``), fan requests out to every node in parallel with bounded waits,
and create batches spread over nodes.

Fan-out returns one result per node, successes kept when some nodes fail (as Fabric's
``GroupResult``); a node that does not answer within the bound is reported as unreachable
and skipped, never waited on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ...core.config import env
from ...core.errors import ConfigError, DsecError, NodeUnreachableError, NotFoundError, UsageError
from ..contract import NodeAPI
from ..node import CreateOptions, local_node
from .errors import CapacityError
from .placement import FastPlacer, NodeView, Placer
from .protocol import error_from_wire
from .registry import get_node, load_nodes
from .remote import RemoteNode

log = logging.getLogger(__name__)
T = TypeVar("T")


def fanout_timeout() -> float:
    raw = env("DSEC_NODE_TIMEOUT") or "15"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"$DSEC_NODE_TIMEOUT: {raw!r} must be a number of seconds above 0")
    return value


@dataclass
class NodeResult:
    node: str
    ok: bool
    value: Any = None
    error: DsecError | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.ok:
            return {"node": self.node, "ok": True, "result": self.value}
        assert self.error is not None
        return {"node": self.node, "ok": False, "error": self.error.message,
                "unreachable": isinstance(self.error, NodeUnreachableError)}


def fanout(fn: Callable[[RemoteNode], T], nodes: list[RemoteNode] | None = None,
           timeout: float | None = None) -> list[NodeResult]:
    """Run ``fn`` on every node at once; each result within ``timeout`` or an error."""
    nodes = nodes if nodes is not None else [RemoteNode(e) for e in load_nodes().values()]
    timeout = timeout or fanout_timeout()
    if not nodes:
        return []
    results: dict[str, NodeResult] = {}
    lock = threading.Lock()
    finished = threading.Semaphore(0)

    def one(n: RemoteNode) -> None:
        try:
            r = NodeResult(n.name, True, fn(n))
        except DsecError as e:
            r = NodeResult(n.name, False, error=e)
        except Exception as e:  # a bug on one node's path must not hide the others' results
            r = NodeResult(n.name, False, error=DsecError(f"{n.name}: {type(e).__name__}: {e}"))
        with lock:
            results.setdefault(n.name, r)
        finished.release()

    # daemon threads, not an executor: a node that never answers must not keep the process
    # alive after the bounded wait (executor threads are joined at exit)
    for n in nodes:
        threading.Thread(target=one, args=(n,), daemon=True, name=f"dsec-fan-{n.name}").start()
    deadline = time.monotonic() + timeout
    for _ in nodes:
        if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    with lock:
        for n in nodes:
            results.setdefault(n.name, NodeResult(n.name, False, error=NodeUnreachableError(
                f"{n.name}: no answer within {timeout:g}s")))
    return [results[n.name] for n in nodes]


# -- routing -------------------------------------------------------------------------------------
def split_id(sid: str) -> tuple[str | None, str]:
    node, sep, local = sid.rpartition("/")
    if sep and (not node or not local):
        raise UsageError(f"invalid sandbox id {sid!r}: expected NODE/ID or ID")
    return (node or None), local


def node_for(sid: str | None = None, node: str | None = None,
             state_dir: str | Path | None = None) -> NodeAPI:
    """The node holding a sandbox: named in its id (``node1/abc``), by ``--node``, or local."""
    name = None
    if sid is not None:
        name, _ = split_id(sid)
    if name and node and node not in (name, "auto"):
        raise UsageError(f"sandbox {sid!r} is on node {name!r}, not {node!r}")
    name = name or node
    if name == "auto":
        raise UsageError("--node auto only places new sandboxes; name the node of an existing "
                         "one (or use its NODE/ID)")
    if not name or name == "local":
        return local_node(state_dir)
    return get_node(name)


# -- placement -----------------------------------------------------------------------------------
def _views(image: str | None, nodes: list[RemoteNode] | None = None
           ) -> tuple[list[NodeView], list[NodeResult]]:
    results = fanout(lambda n: n.info(image), nodes)
    views, skipped = [], []
    for r in results:
        if r.ok and "image_error" not in r.value:
            views.append(NodeView.from_info(r.node, r.value, image))
        else:
            if r.ok:  # the node cannot resolve the image in its store: keep the error's class
                err = error_from_wire(r.value["image_error"], r.node)
                err.message = f"{r.node}: cannot use {image}: " + \
                    str(r.value["image_error"].get("message"))
                r = NodeResult(r.node, False, error=err)
            log.warning("skipping node %s: %s", r.node, r.error)
            skipped.append(r)
    return views, skipped


def _no_node(image: str, skipped: list[NodeResult]) -> DsecError:
    why = "; ".join(str(r.error) for r in skipped) or "no node has room"
    if not load_nodes():
        return UsageError("--node auto needs nodes", hint="dsec node add NAME USER@HOST")
    if skipped and all(isinstance(r.error, NotFoundError) for r in skipped):
        return NotFoundError(f"no node finds {image} in its store: {why}")
    return CapacityError(f"no node can take a sandbox of {image}: {why}")


def create(image: str, opts: CreateOptions, node: str | None = None,
           state_dir: str | Path | None = None) -> tuple[NodeAPI, Any]:
    """Create on the named node, the local one, or (``auto``) the best-scoring node; a node
    that refuses for capacity (another client got there first) passes to the next best."""
    if node != "auto":
        target = node_for(None, node, state_dir)
        return target, target.create(image, opts)
    opts.validate()
    views, skipped = _views(image)
    placer = Placer(views)
    tried: set[str] = set()
    while True:
        ranked = placer.ranked(image, opts.cpus, opts.memory, exclude=tried)
        if not ranked:
            raise _no_node(image, skipped)
        target = RemoteNode(load_nodes()[ranked[0]])
        try:
            return target, target.create(image, opts)
        except (CapacityError, NodeUnreachableError) as e:
            log.info("node %s refused: %s", target.name, e)
            skipped.append(NodeResult(target.name, False, error=e))
            tried.add(target.name)


@dataclass
class CreateResult:
    index: int
    node: str | None
    sandbox: Any = None  # a RemoteRecord
    error: DsecError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def create_many(n: int, image: str, opts: CreateOptions,
                nodes: list[str] | None = None, parallel: int = 8,
                make: Callable[[int, RemoteNode], Any] | None = None) -> list[CreateResult]:
    """``n`` sandboxes spread over the nodes by placement; one result per sandbox, failures
    included (a refused or failed create is retried once on the next best node). ``make``
    creates sandbox ``i`` on the node placement chose (default: a plain create)."""
    if n < 1:
        raise UsageError(f"invalid count {n}: must be at least 1")
    opts.validate()
    entries = load_nodes()
    for name in nodes or []:
        if name not in entries:
            raise UsageError(f"unknown node {name!r}")
    remote = [RemoteNode(entries[x]) for x in (nodes or list(entries))]
    if not remote:
        raise UsageError("create_many needs nodes", hint="dsec node add NAME USER@HOST")
    views, skipped = _views(image, remote)
    placer = FastPlacer(views)
    by_name = {r.name: r for r in remote}
    lock = threading.Lock()
    results: list[CreateResult] = [CreateResult(i, None) for i in range(n)]

    def one(i: int) -> None:
        tried: set[str] = set()
        last: DsecError | None = None
        for _ in range(3):
            with lock:
                name = placer.place(image, opts.cpus, opts.memory, exclude=tried)
            if name is None:
                results[i].error = last or _no_node(image, skipped)
                return
            try:
                rec = make(i, by_name[name]) if make else by_name[name].create(image, opts)
                results[i] = CreateResult(i, name, rec)
                return
            except DsecError as e:
                last, results[i].node = e, name
                with lock:
                    placer.release_on(name, opts.cpus, opts.memory)
                if not isinstance(e, CapacityError | NodeUnreachableError):
                    results[i].error = e  # the create itself failed: not a placement matter
                    return
                tried.add(name)
        results[i].error = last

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(one, range(n)))
    return results


# -- fan-out commands ----------------------------------------------------------------------------
def ps_all(timeout: float | None = None) -> list[NodeResult]:
    return fanout(lambda n: [r.public() for r in n.sandboxes(timeout=timeout)], timeout=timeout)


def gc_all(budget: int | None = None, dry_run: bool = False,
           timeout: float | None = None) -> list[NodeResult]:
    t = timeout or max(fanout_timeout(), 120.0)
    return fanout(lambda n: n.gc(budget, dry_run, timeout=t), timeout=t)


def node_status(timeout: float | None = None, names: list[str] | None = None
                ) -> list[NodeResult]:
    """Reachability, version, capacity, usage and cached bytes of every (or the named) node."""
    entries = load_nodes()
    if names:
        for x in names:
            if x not in entries:
                raise UsageError(f"unknown node {x!r} (configured: {', '.join(entries) or 'none'})")
    nodes = [RemoteNode(entries[x]) for x in (names or list(entries))]
    return fanout(lambda n: n.info(timeout=timeout), nodes, timeout)


def copy_remote(src: str, dst: str, node: str | None = None,
                state_dir: str | Path | None = None) -> dict[str, Any]:
    """`dsec cp` where the sandbox side is ``NODE/ID:PATH`` (or ``ID:PATH`` with --node)."""
    from ..transfer import copy

    def sandbox_side(arg: str) -> tuple[str, str] | None:
        head, sep, tail = arg.partition(":")
        if sep and head and tail and head.count("/") <= 1 and not head.startswith((".", "/")):
            return head, tail
        return None

    s, d = sandbox_side(src), sandbox_side(dst)
    if (s is None) == (d is None):
        raise UsageError("exactly one side of cp must be [NODE/]SANDBOX:PATH, e.g. "
                         "`dsec cp ./f.txt node1/1a2b3c:/tmp/f.txt`")
    sid = (s or d)[0]  # type: ignore[index]
    target = node_for(sid, node, state_dir)
    local = sid.rsplit("/", 1)[-1]
    out = copy(target, f"{local}:{s[1]}" if s else src,  # type: ignore[arg-type]
               f"{local}:{d[1]}" if d else dst)
    if isinstance(target, RemoteNode):
        out["sandbox"] = f"{target.name}/{local}"
    return out
