"""Every thread/asyncio pair offers the same methods with the same full signatures: parameter
names, kinds, defaults and annotations, and the return annotation, modulo async (an
``AsyncX`` stands for its ``X``, and the asyncio stdin and output callback types take
everything the thread types take). What differs on purpose is listed in `DIFFERENT`, each
with why; an entry that no longer differs fails too, so the list stays true."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from dsec_cli.api import aio_jobs, jobs
from dsec_cli.api.aio import AsyncSandbox
from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.backends.sandbox_agent.aio import AsyncAgentClient
from dsec_cli.backends.sandbox_agent.client import AgentClient
from dsec_cli.run.aio import AsyncNode
from dsec_cli.run.cluster.aio import AsyncChannel, AsyncRemoteNode
from dsec_cli.run.cluster.remote import Channel, RemoteNode
from dsec_cli.run.node import Node

#: (thread class, asyncio class, whether the asyncio class must have every public method)
PAIRS: list[tuple[type, type, bool]] = [
    (Sandbox, AsyncSandbox, True),
    (jobs.Job, aio_jobs.AsyncJob, True),
    (jobs.Rollout, aio_jobs.AsyncRollout, True),
    (jobs.Group, aio_jobs.AsyncGroup, True),
    (jobs.Member, aio_jobs.AsyncMember, True),
    # the node faces and the clients: the asyncio side has what the asyncio SDK awaits
    # directly (the rest runs the thread API on the shared executor); what both have, alike
    (Node, AsyncNode, False),
    (RemoteNode, AsyncRemoteNode, False),
    (Channel, AsyncChannel, False),
    (AgentClient, AsyncAgentClient, False),
]

#: methods compared under other names (their parameters): the constructors that take a
#: sandbox's or a job's options (``Sandbox(...)``; ``await AsyncSandbox.create(...)``: an
#: ``__init__`` cannot be awaited)
RENAMED: list[tuple[Callable[..., Any], Callable[..., Any]]] = [
    (Sandbox.__init__, AsyncSandbox.create),
    (jobs.Job.__init__, aio_jobs.AsyncJob.start),
]

DIFFERENT: dict[str, str] = {
    # made by `create`/`attach` from a record and its node (an __init__ cannot await)
    "AsyncSandbox.__init__": "takes the record and the async node",
    "AsyncSandbox.create": "spelled out; Sandbox.create is Sandbox(...) (see RENAMED)",
    "AsyncJob.__init__": "takes the job's NodeJobs and settings; made by start/attach",
    "AsyncJob.start": "spelled out; Job.start is Job(...) (see RENAMED)",
    "AsyncJob.start~Job.__init__": "Job(...)'s private _create flag is attach's",
    "AsyncJob.prewarm": "an asyncio.Task of the loop where Job's is a concurrent Future",
    "AsyncMember.__init__": "its done event is the loop's asyncio.Event",
    # the node contract (NodeAPI), which AsyncRemoteNode shares: no pool or reserved id
    # (the node service's admission is thread code), no pooled lookup (removal's)
    "AsyncNode.__init__": "wraps a Node",
    "AsyncNode.create": "the node contract's create: no from_pool, no sid",
    "AsyncNode.lookup": "the node contract's lookup: no pooled",
    "AsyncChannel.__init__": "takes its ssh subprocess; opened by AsyncChannel.open",
    "AsyncAgentClient.__init__": "takes asyncio streams; opened by connect_unix",
}

#: the asyncio types standing for the thread types, and what they take
ASYNC_STDIN = {"bytes", "str", "Iterable[bytes]", "AsyncIterable[bytes]", "None"}


def _norm(annotation: Any, name: str = "") -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    a = str(annotation).replace("AsyncOutputCallback", "OutputCallback")
    if name == "stdin":
        parts = {p.strip() for p in a.split("|")}
        if a == "AsyncStdin" or parts <= ASYNC_STDIN:
            return "STDIN"  # the asyncio stdin takes every thread stdin type
    return re.sub(r"\bAsync(\w+)", r"\1", a)


def _shape(fn: Callable[..., Any]) -> tuple[list[tuple[Any, ...]], Any]:
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, _norm(p.annotation, p.name))
              for p in sig.parameters.values() if p.name not in ("self", "cls")]
    return params, _norm(sig.return_annotation)


def _public(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items()
                  if (not n.startswith("_") or n == "__init__")
                  and callable(getattr(cls, n)) and not isinstance(v, property))


def _differences() -> dict[str, str]:
    out: dict[str, str] = {}
    for sync, aio, complete in PAIRS:
        for name in _public(aio):
            s = getattr(sync, name, None)
            if s is None:
                continue  # asyncio only (aclose, forget, open, ...)
            a = getattr(aio, name)
            if name != "__init__":
                assert inspect.iscoroutinefunction(a) or name in ("kill_agent",), \
                    f"{aio.__name__}.{name} is not a coroutine function"
            if _shape(s) != _shape(a):
                out[f"{aio.__name__}.{name}"] = f"{_shape(s)}\n  != {_shape(a)}"
        if complete:
            missing = [n for n in _public(sync) if n != "__init__" and not hasattr(aio, n)]
            assert not missing, f"{aio.__name__} lacks {missing}"
    for s, a in RENAMED:  # a constructor returns None, `create` the object: params only
        if _shape(s)[0] != _shape(a)[0]:
            key = f"{a.__qualname__}~{s.__qualname__}"
            out[key] = f"{_shape(s)}\n  != {_shape(a)}"
    return out


def test_every_pair_has_the_same_signatures() -> None:
    found = _differences()
    unexplained = {k: v for k, v in found.items() if k not in DIFFERENT}
    assert not unexplained, "\n".join(f"{k}: {v}" for k, v in unexplained.items())
    stale = sorted(set(DIFFERENT) - set(found))
    assert not stale, f"these no longer differ: drop them from DIFFERENT: {stale}"
