"""Jobs across the cluster: the node service's ``job`` request (a cluster node's `NodeJobs`,
run/jobs.py, method by method from an allowlist) and `RemoteJobs`, the client side with the
same methods, so a job's rollouts on other nodes are journaled, leased and swept there."""

from __future__ import annotations

from typing import Any

from ...backends.base import ExecResult
from ...core.errors import UsageError
from ..jobs import node_jobs
from ..node import Node
from .admission import Admission
from .protocol import b64, from_wire, to_wire, unb64
from .remote import RemoteNode

#: what a cluster client may ask of a node's jobs
METHODS = frozenset({"start", "get", "renew", "reattach", "park", "thaw", "remove",
                     "add_rollout", "rollout", "rollouts", "release", "exec", "journal",
                     "replay", "snapshot"})


def serve(node: Node, admission: Admission, args: dict[str, Any]) -> Any:
    """One ``job`` request: ``{"method": NAME, "args": {...}}``."""
    method, kw = args.get("method"), args.get("args") or {}
    if method not in METHODS or not isinstance(kw, dict):
        raise UsageError(f"unknown job request {method!r}")
    jobs = node_jobs(node)
    try:
        if method == "exec":
            if kw.get("stdin") is not None:
                kw["stdin"] = unb64(kw["stdin"])
            res, step = jobs.exec(**kw)
            return {"result": to_wire(res), "step": step}
        if method == "journal":
            docs = jobs.journal(**kw)
            for d in docs:
                if "stdout" in d:
                    d["stdout"], d["stderr"] = b64(d["stdout"]), b64(d["stderr"])
            return docs
        if method == "add_rollout":
            opts = kw.get("opts") or {}
            token = admission.reserve(opts.get("cpus"), opts.get("memory"))
            try:
                return jobs.add_rollout(**kw)
            finally:
                admission.release(token)
        return getattr(jobs, method)(**kw)
    except TypeError as e:  # arguments that do not fit the method
        raise UsageError(f"job request {method!r}: {e}") from None


class RemoteJobs:
    """A cluster node's jobs, with the methods of `NodeJobs` the API uses."""

    def __init__(self, node: RemoteNode) -> None:
        self.node = node
        self.name = node.name

    def _call(self, method: str, **kw: Any) -> Any:
        return self.node.call("job", {"method": method, "args": kw}, timeout=None)

    def start(self, name: str, settings: dict[str, Any] | None = None,
              exist_ok: bool = True) -> dict[str, Any]:
        return dict(self._call("start", name=name, settings=settings, exist_ok=exist_ok))

    def get(self, name: str) -> dict[str, Any]:
        return dict(self._call("get", name=name))

    def renew(self, name: str, ttl: float | None = None) -> dict[str, Any]:
        return dict(self._call("renew", name=name, ttl=ttl))

    def reattach(self, name: str) -> dict[str, Any]:
        return dict(self._call("reattach", name=name))

    def park(self, name: str) -> dict[str, Any]:
        return dict(self._call("park", name=name))

    def thaw(self, name: str, prefetch: bool = False) -> dict[str, Any]:
        if prefetch:  # only when asked: a node older than the option still thaws
            return dict(self._call("thaw", name=name, prefetch=True))
        return dict(self._call("thaw", name=name))

    def remove(self, name: str) -> dict[str, Any]:
        return dict(self._call("remove", name=name))

    def add_rollout(self, name: str, image: str, opts: dict[str, Any],
                    group: str | None = None, index: int | None = None,
                    ticket: str | None = None) -> dict[str, Any]:
        # the ticket is the home node's (admission to the job's cap is decided there): kept
        # with the rollout so that a resumed trainer frees it on release
        return dict(self._call("add_rollout", name=name, image=image, opts=opts, group=group,
                               index=index, ticket=ticket))

    def rollout(self, rid: str) -> dict[str, Any]:
        return dict(self._call("rollout", rid=rid))

    def rollouts(self, name: str) -> list[dict[str, Any]]:
        return list(self._call("rollouts", name=name))

    def release(self, rid: str) -> dict[str, Any]:
        return dict(self._call("release", rid=rid))

    def exec(self, rid: str, argv: list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | None = None, timeout: float | None = None,
             key: str | None = None, capture_limit: int | None = None
             ) -> tuple[ExecResult, dict[str, Any]]:
        r = self._call("exec", rid=rid, argv=list(argv), env=env, cwd=cwd,
                       stdin=None if stdin is None else b64(stdin), timeout=timeout, key=key,
                       capture_limit=capture_limit)
        return from_wire(ExecResult, r["result"]), dict(r["step"])

    def journal(self, rid: str, output: bool = True) -> list[dict[str, Any]]:
        docs = list(self._call("journal", rid=rid, output=output))
        for d in docs:
            if "stdout" in d:
                d["stdout"], d["stderr"] = unb64(d["stdout"]), unb64(d["stderr"])
        return docs

    def replay(self, rid: str) -> dict[str, Any]:
        return dict(self._call("replay", rid=rid))

    def snapshot(self, rid: str) -> dict[str, Any] | None:
        out = self._call("snapshot", rid=rid)
        return None if out is None else dict(out)
