"""The sandbox SDK: what `dsec run/exec/cp/ps/rm/pause/resume/snapshot` do, as Python objects,
so a trainer creates and drives sandboxes without shelling out.

    from dsec_cli.run.sdk import Sandbox
    with Sandbox.create("busybox@1.35-1", memory="256M", ttl="10m") as sb:
        r = sb.exec("echo hi")          # ExecResult(exit_code, stdout, stderr, duration, ...)
        sb.write_file("/tmp/x", b"data")
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

from ..backends.base import ExecResult, OutputCallback
from ..backends.fnpool import FunctionCallError, FunctionPool
from ..core import validate
from .node import CreateOptions, Node, local_node
from .state import SandboxRecord

__all__ = ["Sandbox", "ExecResult", "FunctionPool", "FunctionCallError", "run",
           "list_sandboxes", "gc_node", "create_many"]


def _size(v: int | str | None, what: str) -> int | None:
    return None if v is None else v if isinstance(v, int) else validate.size(v, what)


def _secs(v: float | str | None, what: str) -> float | None:
    return None if v is None else float(v) if isinstance(v, int | float) \
        else validate.duration(v, what)


class Sandbox:
    """A sandbox on this node or on a cluster node (``node=``; its id is then ``NODE/ID``).
    ``Sandbox(image, ...)`` creates one (as `create` does); use it as a context manager to
    remove it on exit."""

    _rec: SandboxRecord | Any  # a remote node's records are plain objects of the same shape
    node: Node | Any  # the local Node or a cluster RemoteNode, with the same methods

    def __init__(self, image: str | Path, backend: str = "container", *,
                 cpus: float | None = None, memory: int | str | None = None,
                 pids: int | None = None, ttl: float | str | None = None,
                 network: Literal["none", "host"] = "none", env: dict[str, str] | None = None,
                 workdir: str | None = None, state_dir: str | Path | None = None,
                 store: str | None = None, node: str | None = None,
                 disk: int | str | None = None) -> None:
        """``node``: a configured cluster node's name, ``"auto"`` (placed by free capacity
        and cached image bytes) or ``None``/``"local"`` for this machine. ``disk``: bytes
        (or "1G") the sandbox may write; past it writes fail with ENOSPC inside."""
        if isinstance(image, str):
            validate.image(image, "image")
        validate.node_option(node, "node")
        validate.positive_float(cpus, "cpus")
        validate.positive_int(pids, "pids")
        opts = CreateOptions(backend=backend, cpus=cpus, memory=_size(memory, "memory"),
                             pids=pids, ttl=_secs(ttl, "ttl"), network=network,
                             env=dict(env or {}), workdir=workdir, disk=_size(disk, "disk"))
        if node and node != "local":
            from .cluster.api import create

            target, rec = create(str(image), opts, node, state_dir)
            self._rec, self.node = rec, target
            return
        local = local_node(state_dir, store)
        self._rec = local.create(str(image), opts)
        self.node = local

    @classmethod
    def _wrap(cls, record: SandboxRecord | Any, node: Node | Any) -> Sandbox:
        sb = cls.__new__(cls)
        sb._rec, sb.node = record, node
        return sb

    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def backend(self) -> str:
        return self._rec.backend

    @property
    def image(self) -> str:
        return self._rec.image

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, image={self.image!r}, backend={self.backend!r})"

    @classmethod
    def create(cls, image: str | Path, backend: str = "container", **options: Any) -> Sandbox:
        """Same as ``Sandbox(image, backend, **options)``."""
        return cls(image, backend, **options)

    @classmethod
    def attach(cls, sandbox_id: str, *, state_dir: str | Path | None = None) -> Sandbox:
        validate.sandbox_id(sandbox_id)
        if "/" in sandbox_id:  # NODE/ID: a cluster node's sandbox
            from .cluster.api import node_for

            remote = node_for(sandbox_id)
            return cls._wrap(remote.lookup(sandbox_id), remote)
        node = local_node(state_dir)
        return cls._wrap(node.lookup(sandbox_id), node)

    def exec(self, cmd: str | list[str], *, stdin: bytes | str | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None,
             timeout: float | None = None, on_output: OutputCallback | None = None
             ) -> ExecResult:
        """Run a command (a list, or a string for `sh -c`); returns stdout, stderr, the exit
        code and the duration. A failing command is a result, not an exception."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return self.node.exec(self.id, argv, env=env, cwd=cwd, stdin=data, timeout=timeout,
                              on_output=on_output)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.node.put_file(self.id, path, data.encode() if isinstance(data, str) else data, mode)

    def read_file(self, path: str) -> bytes:
        return self.node.get_file(self.id, path)

    def pause(self) -> None:
        self._rec = self.node.pause(self.id)

    def resume(self) -> None:
        self._rec = self.node.resume(self.id)

    def snapshot(self, ref: str, push: str | None = None) -> dict[str, Any]:
        return self.node.snapshot(self.id, ref, push)

    def info(self) -> dict[str, Any]:
        return self.node.describe(self.id)

    def remove(self) -> None:
        self.node.remove(self.id)

    close = remove

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def run(image: str | Path, cmd: str | list[str], backend: str = "container",
        **options: Any) -> ExecResult:
    """Create a sandbox, run one command in it, remove it."""
    exec_opts = {k: options.pop(k) for k in ("stdin", "timeout", "on_output", "cwd")
                 if k in options}
    with Sandbox.create(image, backend, **options) as sb:
        return sb.exec(cmd, **exec_opts)


def list_sandboxes(state_dir: str | Path | None = None, *, node: str | None = None,
                   all_nodes: bool = False) -> list[dict[str, Any]]:
    """This node's sandboxes, a cluster node's, or (``all_nodes``) every reachable node's;
    a node that does not answer is skipped (see `dsec_cli.run.cluster.api.ps_all` for the
    per-node results)."""
    if all_nodes:
        from .cluster.api import ps_all

        return [d for r in ps_all() if r.ok for d in r.value]
    if node and node != "local":
        from .cluster.api import node_for

        return [r.public() for r in node_for(None, node).sandboxes()]
    return [r.public() for r in local_node(state_dir).sandboxes()]


def create_many(n: int, image: str | Path, backend: str = "container", *,
                nodes: list[str] | None = None, parallel: int = 8, cpus: float | None = None,
                memory: int | str | None = None, pids: int | None = None,
                ttl: float | str | None = None, network: Literal["none", "host"] = "none",
                env: dict[str, str] | None = None, workdir: str | None = None,
                disk: int | str | None = None) -> list[Any]:
    """Create ``n`` sandboxes spread over the cluster's nodes (or ``nodes``) by placement.

    Returns one `CreateResult` per sandbox, in order: ``.ok``, ``.node``, ``.sandbox`` (a
    `Sandbox`) or ``.error`` (the `DsecError` of that one create). Failures do not stop the
    batch; a node that refuses for capacity or does not answer passes the sandbox on to the
    next best node."""
    from .cluster.api import RemoteNode
    from .cluster.api import create_many as _create_many
    from .cluster.registry import load_nodes

    opts = CreateOptions(backend=backend, cpus=cpus, memory=_size(memory, "memory"),
                         pids=pids, ttl=_secs(ttl, "ttl"), network=network,
                         env=dict(env or {}), workdir=workdir, disk=_size(disk, "disk"))
    results = _create_many(n, str(image), opts, nodes, parallel)
    entries = load_nodes()
    for r in results:
        if r.ok and r.node is not None:
            r.sandbox = Sandbox._wrap(r.sandbox, RemoteNode(entries[r.node]))
    return results


def gc_node(budget: int | str | None = None, dry_run: bool = False,
            state_dir: str | Path | None = None) -> dict[str, Any]:
    return local_node(state_dir).gc(_size(budget, "cache budget"), dry_run)


def shell_join(argv: list[str]) -> str:
    return shlex.join(argv)
