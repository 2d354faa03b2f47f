"""Sandboxes: what `dsec run/exec/cp/ps/rm/pause/resume/snapshot` do, as Python objects and
functions, so a trainer creates and drives sandboxes without shelling out. Routing is decided
here and nowhere else: a ``NODE/ID`` sandbox id or ``node=NAME`` goes to that cluster node,
``node="auto"`` places a new sandbox by capacity and cache, anything else stays on this machine.

    from dsec_cli.api.sandboxes import Sandbox
    with Sandbox.create("busybox@1.35-1", memory="256M", ttl="10m") as sb:
        r = sb.exec("echo hi")          # ExecResult(exit_code, stdout, stderr, duration, ...)
        sb.write_file("/tmp/x", b"data")
"""

from __future__ import annotations

import logging
import shlex
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..backends.base import ExecResult, OutputCallback
from ..core import validate
from ..core.errors import NotFoundError, UsageError
from ..oci import runconfig
from ..run.contract import NodeAPI
from ..run.fork import check_count
from ..run.node import CreateOptions, Node, local_node
from ..run.node import drop_connections as drop_node_connections
from ..run.options import CPU_CLASS_CHOICES as CPU_CLASSES  # cpu_class= values
from ..run.state import SandboxRecord
from .options import create_options, new_sandbox_options
from .options import size as _size
from .routing import target

__all__ = ["Sandbox", "ExecResult", "FunctionPool", "FunctionCallError", "CreateOptions", "NodeAPI",
           "run", "new_sandbox_options", "exec_argv", "refuse_key",
           "list_sandboxes", "gc_node", "create_many", "create", "create_options", "target",
           "exec_in", "command_for", "copy", "ps", "remove", "pause", "resume", "snapshot",
           "fork", "park", "thaw", "top", "CPU_CLASSES", "drop_connections"]

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..backends.fnpool import FunctionCallError, FunctionPool


def __getattr__(name: str) -> Any:
    """`FunctionPool` and `FunctionCallError` load on first use: a command that only execs in
    a sandbox does not import the function pool."""
    if name in ("FunctionPool", "FunctionCallError"):
        from ..backends import fnpool

        return getattr(fnpool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Sandbox:
    """A sandbox on this node or on a cluster node (``node=``; its id is then ``NODE/ID``).
    ``Sandbox(image, ...)`` creates one (as `create` does); use it as a context manager to
    remove it on exit."""

    _rec: SandboxRecord | Any  # a remote node's records are plain objects of the same shape
    node: NodeAPI  # the local Node or a cluster RemoteNode

    def __init__(self, image: str | Path, backend: str = "container", *,
                 cpus: float | None = None, memory: int | str | None = None,
                 pids: int | None = None, ttl: float | str | None = None,
                 network: Literal["none", "host", "allowlist"] = "none",
                 env: dict[str, str] | None = None,
                 workdir: str | None = None, state_dir: str | Path | None = None,
                 store: str | None = None, node: str | None = None,
                 disk: int | str | None = None, cpu_class: str | None = None,
                 egress: list[str] | None = None, user: str | None = None,
                 remove_at_exit: bool = False) -> None:
        """``node``: a configured cluster node's name, ``"auto"`` (placed by free capacity
        and cached image bytes) or ``None``/``"local"`` for this machine. ``disk``: bytes
        (or "1G") the sandbox may write; past it writes fail with ENOSPC inside.
        ``cpu_class``: ``latency`` (exec answers stay fast), ``batch`` (the default) or
        ``idle`` (runs only when nothing else wants the CPU).
        ``network="allowlist"`` with ``egress=["host:8080", ...]``: only those leave, enforced
        on the host's side; change it later with `set_egress`. ``user``: who commands run as
        (NAME, UID, NAME:GROUP, UID:GID; default: the image's user). ``remove_at_exit``:
        the sandbox is removed when this object is garbage collected or the interpreter
        exits, whichever comes first (otherwise it lives until removed or its ttl)."""
        opts = new_sandbox_options(image, node, backend, cpus=cpus, memory=memory, pids=pids,
                                   ttl=ttl, network=network, env=env, workdir=workdir,
                                   disk=disk, cpu_class=cpu_class, user=user, egress=egress)
        self.node, self._rec = create(image, opts, node, state_dir, store)
        self._finalizer = removal_at_exit(self, self.node, self.id) if remove_at_exit else None

    @classmethod
    def _wrap(cls, record: SandboxRecord | Any, node: NodeAPI) -> Sandbox:
        sb = cls.__new__(cls)
        sb._rec, sb.node, sb._finalizer = record, node, None
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
        node = target(sandbox_id, state_dir=state_dir)
        return cls._wrap(node.lookup(sandbox_id), node)

    def exec(self, cmd: str | list[str], *,
             stdin: bytes | str | Iterable[bytes] | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None,
             timeout: float | None = None, on_output: OutputCallback | None = None,
             capture_limit: int | None = None, user: str | None = None,
             key: str | None = None) -> ExecResult:
        """Run a command (a list, or a string for `sh -c`); returns stdout, stderr, the exit
        code and the duration. A failing command is a result, not an exception. Output is
        kept in the result up to ``capture_limit`` bytes per stream (None: all of it).
        ``user`` overrides the sandbox's user for this command. In a job's sandbox on this
        node the exec is a journaled step (as `dsec exec`), and ``key`` makes it run at most
        once."""
        argv = exec_argv(cmd)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        extra = _user_kw(self.node, user)
        if isinstance(self.node, Node) and (self.node.root / "jobs.db").exists():
            from .jobs import journaled_exec

            res = journaled_exec(self.node, self.id, argv, key=key, stdin=data, env=env,
                                 cwd=cwd, timeout=timeout, on_output=on_output,
                                 capture_limit=capture_limit, **extra)
            if res is not None:
                return res
        refuse_key(key, "Job")
        return self.node.exec(self.id, argv, env=env, cwd=cwd, stdin=data, timeout=timeout,
                              on_output=on_output, capture_limit=capture_limit, **extra)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644, *,
                   user: str | None = None) -> None:
        """Create or truncate a file and write ``data``; missing parent directories are
        made. Done as the sandbox's user (``user`` overrides it, as for exec): permissions
        apply, and the file and the directories made are that user's."""
        self.node.put_file(self.id, path, data.encode() if isinstance(data, str) else data,
                           mode, **_user_kw(self.node, user))

    def read_file(self, path: str, *, user: str | None = None) -> bytes:
        """A regular file's content, read as the sandbox's user (or ``user``)."""
        return self.node.get_file(self.id, path, **_user_kw(self.node, user))

    def pause(self) -> None:
        self._rec = self.node.pause(self.id)

    def resume(self) -> None:
        self._rec = self.node.resume(self.id)

    def snapshot(self, ref: str, push: str | None = None, *, replace: bool = False
                 ) -> dict[str, Any]:
        return self.node.snapshot(self.id, ref, push, replace=replace)

    def park(self) -> dict[str, Any]:
        """Stop the sandbox and give its memory back (to swap where the node has swap);
        returns its resident, reclaimed and swapped bytes. `thaw` brings it back."""
        return self.node.park(self.id)

    def thaw(self, prefetch: bool = False, to: str | None = None) -> dict[str, Any]:
        """Let a parked sandbox run again: same files, same processes. ``prefetch`` also
        reads its memory back from swap now, so its next commands do not wait for it. With
        ``to``, a parked VM moves to that node first (this object then names it there)."""
        if to is None:
            return self.node.thaw(self.id, prefetch)
        _no_prefetch_with_to(prefetch)
        out = thaw_to(self.node, self.id, to)
        self.node = target(None, to)
        self._rec = self.node.lookup(str(out["id"]))
        return out

    def fork(self, n: int) -> list[Sandbox]:
        """``n`` new sandboxes on the same node, each starting from this one's files as they
        are now (copy-on-write where the backend snapshots: the diff becomes one layer that
        every copy stacks). Writes of one copy are invisible to the others and to this one.
        Processes are not copied. Remove the copies as any sandbox."""
        out = self.node.fork(self.id, n)
        return [Sandbox._wrap(r, self.node) for r in out["copies"]]

    def copy_in(self, src: str | Path, dst: str) -> dict[str, Any]:
        """Copy a host file into the sandbox at ``dst`` (as `dsec cp SRC ID:DST`)."""
        return copy(str(src), f"{self.id}:{dst}", state_dir=_state_dir(self.node))

    def copy_out(self, src: str, dst: str | Path) -> dict[str, Any]:
        """Copy a file, symlink or directory out of the sandbox to host path ``dst``."""
        return copy(f"{self.id}:{src}", str(dst), state_dir=_state_dir(self.node))

    def info(self) -> dict[str, Any]:
        return self.node.describe(self.id)

    def set_egress(self, rules: list[str]) -> dict[str, Any]:
        """Replace what this sandbox may reach (``[]``: nothing); logged beside it."""
        from ..run.network import set_egress

        if not isinstance(self.node, Node):  # a cluster node changes it on its side
            return self.node.set_egress(self.id, list(rules))  # type: ignore[attr-defined]
        return set_egress(self.node, self.id, rules)

    def start_task(self) -> dict[str, Any]:
        """Record the task's protected paths now; `grade` reports what changed since."""
        from .grading import start_task

        return start_task(self.id, state_dir=getattr(self.node, "root", None))

    def grade(self, grader: str, **options: Any) -> Any:
        """Score this sandbox in a fork with the grader image ``grader`` (a `GradeResult`:
        reward, per-test outcomes, log, tamper audit); see `dsec_cli.api.grading.grade`."""
        from .grading import grade

        options.setdefault("state_dir", getattr(self.node, "root", None))
        return grade(self.id, grader, **options)

    def remove(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        self.node.remove(self.id)

    close = remove

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def removal_at_exit(owner: object, node: NodeAPI, sandbox_id: str) -> weakref.finalize:
    """Remove ``sandbox_id`` when ``owner`` is collected or, at the latest, when the
    interpreter exits: a finalizer runs at exit before modules are torn down, where a
    ``__del__`` would find builtins such as ``open`` already gone."""
    return weakref.finalize(owner, _remove_quietly, node, sandbox_id)


def _remove_quietly(node: NodeAPI, sandbox_id: str) -> None:
    try:
        node.remove(sandbox_id)
    except NotFoundError:
        pass  # removed by other means
    except Exception as e:  # a finalizer has no caller to raise to
        log.warning("could not remove sandbox %s: %s", sandbox_id, e)


def exec_argv(cmd: str | list[str]) -> list[str]:
    """What an exec runs: a list as given, a string under `sh -c`."""
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def refuse_key(key: str | None, job_class: str) -> None:
    """An exec reached here is no job's step: a ``key`` (run at most once) is refused."""
    if key is not None:
        raise UsageError("exec key= needs a sandbox owned by a job on this node",
                         hint=f"make it with `{job_class}.sandbox` or `dsec run --job`")


def _user_kw(node: NodeAPI | None, user: str | None) -> dict[str, str]:
    """``user=`` for an exec or file access on this node (``node`` None: the asyncio face
    of this node); refused for a cluster node's sandbox (which acts as its sandbox's
    user)."""
    if user is None:
        return {}
    if node is not None and not isinstance(node, Node):
        raise UsageError("a user (for an exec or a file) can be given only on this node's "
                         "sandboxes",
                         hint="create the sandbox with the user instead")
    return {"user": user}


def _state_dir(node: NodeAPI) -> Path | None:
    """A local node's state dir (None for a cluster node: its ids carry the node)."""
    root = getattr(node, "root", None)
    return root if isinstance(root, Path) else None


def run(image: str | Path, cmd: str | list[str] | None = None, backend: str = "container",
        *, entrypoint: str | None = None, **options: Any) -> ExecResult:
    """Create a sandbox, run one command in it, remove it. Without ``cmd``, the image's
    entrypoint and cmd; with it, ``cmd`` follows the image's entrypoint (OCI semantics,
    see `command_for`); ``entrypoint`` replaces the image's ("" for none)."""
    exec_opts = {k: options.pop(k) for k in ("stdin", "timeout", "on_output", "cwd")
                 if k in options}
    with Sandbox.create(image, backend, **options) as sb:
        given = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
        return sb.exec(command_for(sb._rec, given, entrypoint), **exec_opts)


def command_for(record: SandboxRecord | Any, cmd: list[str] | None,
                entrypoint: str | None = None) -> list[str]:
    """What a run of ``cmd`` starts in a sandbox of this record's image: the image's
    entrypoint (or ``entrypoint``, "" for none) followed by ``cmd``, else by the image's
    cmd (dropped when the entrypoint was given). An empty result is refused."""
    spec = getattr(record, "spec", None) or {}
    argv = runconfig.command(spec.get("entrypoint"), spec.get("cmd"), cmd, entrypoint)
    if not argv:
        raise UsageError("no command: give one after --, use -d to leave the sandbox "
                         "running, or run an image that has an entrypoint or cmd")
    return argv


def list_sandboxes(state_dir: str | Path | None = None, *, node: str | None = None,
                   all_nodes: bool = False) -> list[dict[str, Any]]:
    """This node's sandboxes, a cluster node's, or (``all_nodes``) every reachable node's;
    a node that does not answer is skipped (see `dsec_cli.run.cluster.api.ps_all` for the
    per-node results)."""
    if all_nodes:
        return ps(all_nodes=True)[0]
    return [r.public() for r in target(None, node, state_dir).sandboxes()]


def create_many(n: int, image: str | Path, backend: str = "container", *,
                nodes: list[str] | None = None, parallel: int = 8, cpus: float | None = None,
                memory: int | str | None = None, pids: int | None = None,
                ttl: float | str | None = None, network: Literal["none", "host"] = "none",
                env: dict[str, str] | None = None, workdir: str | None = None,
                disk: int | str | None = None, cpu_class: str | None = None) -> list[Any]:
    """Create ``n`` sandboxes spread over the cluster's nodes (or ``nodes``) by placement.

    Returns one `CreateResult` per sandbox, in order: ``.ok``, ``.node``, ``.sandbox`` (a
    `Sandbox`) or ``.error`` (the `DsecError` of that one create). Failures do not stop the
    batch; a node that refuses for capacity or does not answer passes the sandbox on to the
    next best node."""
    from ..run.cluster.api import RemoteNode
    from ..run.cluster.api import create_many as _create_many
    from ..run.cluster.registry import load_nodes

    opts = create_options(backend, cpus=cpus, memory=memory, pids=pids, ttl=ttl,
                          network=network, env=env, workdir=workdir, disk=disk,
                          cpu_class=cpu_class)
    results = _create_many(n, str(image), opts, nodes, parallel)
    entries = load_nodes()
    for r in results:
        if r.ok and r.node is not None:
            r.sandbox = Sandbox._wrap(r.sandbox, RemoteNode(entries[r.node]))
    return results


def gc_node(budget: int | str | None = None, dry_run: bool = False,
            state_dir: str | Path | None = None) -> dict[str, Any]:
    """This node's expired or dead sandboxes, and least recently used layers past ``budget``."""
    return local_node(state_dir).gc(_size(budget, "cache budget"), dry_run)


def shell_join(argv: list[str]) -> str:
    return shlex.join(argv)


# -- routing and the functions the CLI calls ----------------------------------------------------
def create(image: str | Path, opts: CreateOptions, node: str | None = None,
           state_dir: str | Path | None = None, store: str | None = None
           ) -> tuple[NodeAPI, SandboxRecord | Any]:
    """Create a sandbox on ``node`` (a name, ``auto`` or ``local``/None); returns the node
    that holds it and its record."""
    validate.node_option(node, "--node")
    if node and node != "local":
        from ..run.cluster.api import create as create_remote

        return create_remote(str(image), opts, node, state_dir)
    local = local_node(state_dir, store)
    return local, local.create(str(image), opts)


def exec_in(sandbox_id: str, argv: list[str], *, node: str | None = None,
            state_dir: str | Path | None = None, **kw: Any) -> ExecResult:
    """Run ``argv`` in a sandbox (keywords as `NodeAPI.exec`); in a job's sandbox on this
    node, as a journaled step (api/jobs.py)."""
    node_api = target(sandbox_id, node, state_dir)
    kw.update(_user_kw(node_api, kw.pop("user", None)))
    if isinstance(node_api, Node) and (node_api.root / "jobs.db").exists():
        from .jobs import journaled_exec

        res = journaled_exec(node_api, sandbox_id, argv, **kw)
        if res is not None:
            return res
    return node_api.exec(sandbox_id, argv, **kw)


def copy(src: str, dst: str, node: str | None = None,
         state_dir: str | Path | None = None) -> dict[str, Any]:
    """Copy into or out of a sandbox; one side is ``[NODE/]SANDBOX:PATH``."""
    validate.node_option(node, "--node")
    if node or "/" in src.partition(":")[0] or "/" in dst.partition(":")[0]:
        from ..run.cluster.api import copy_remote

        return copy_remote(src, dst, node, state_dir)
    from ..run.transfer import copy as copy_local

    return copy_local(local_node(state_dir), src, dst)


def ps(state_dir: str | Path | None = None, node: str | None = None, *,
       all_nodes: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Sandboxes (with lazy-fetch statistics where the node keeps them), and the nodes of
    an ``all_nodes`` fan-out that did not answer. ``all_nodes`` is this machine's sandboxes
    and every configured node's."""
    if not all_nodes:
        return _listing(target(None, node, state_dir)), []
    from ..run.cluster.api import ps_all

    recs = _listing(target(None, None, state_dir))
    failed: list[dict[str, Any]] = []
    for r in ps_all():
        if r.ok:
            recs.extend(r.value)
        else:
            failed.append(r.to_dict())
    return recs, failed


def _listing(node_api: NodeAPI) -> list[dict[str, Any]]:
    out = []
    records = node_api.sandboxes()
    # actual use beside the declared limits: resident, reclaimed and swapped bytes, class
    use = {u["id"]: u for u in node_api.top()} if records else {}
    for r in records:
        doc = r.public()
        stats = node_api.fetch_stats(r)
        if stats is not None:
            doc["fetch"] = stats  # bytes fetched / from cache, stall time (lazy mounts)
        u = use.get(doc["id"])
        if u is not None:
            doc["usage"] = {k: u[k] for k in ("class", "resident", "reclaimed", "swapped",
                                              "idle_seconds") if k in u}
        out.append(doc)
    return out


def remove(sandbox_ids: list[str], node: str | None = None,
           state_dir: str | Path | None = None) -> list[str]:
    """Remove sandboxes; every id is looked up before anything is removed."""
    found = [(n, n.lookup(s)) for s in sandbox_ids for n in [target(s, node, state_dir)]]
    return [n.remove(r.id).id for n, r in found]


def pause(sandbox_id: str, node: str | None = None,
          state_dir: str | Path | None = None) -> SandboxRecord | Any:
    return target(sandbox_id, node, state_dir).pause(sandbox_id)


def resume(sandbox_id: str, node: str | None = None,
           state_dir: str | Path | None = None) -> SandboxRecord | Any:
    return target(sandbox_id, node, state_dir).resume(sandbox_id)


def snapshot(sandbox_id: str, ref: str, push: str | None = None, node: str | None = None,
             state_dir: str | Path | None = None, *, replace: bool = False) -> dict[str, Any]:
    """Turn a sandbox's changes into a new layer and an image ``ref`` stacking it."""
    return target(sandbox_id, node, state_dir).snapshot(sandbox_id, ref, push, replace=replace)


def park(sandbox_id: str, node: str | None = None,
         state_dir: str | Path | None = None) -> dict[str, Any]:
    """Stop a sandbox and push its memory out; its resident, reclaimed and swapped bytes."""
    return target(sandbox_id, node, state_dir).park(sandbox_id)


def thaw(sandbox_id: str, node: str | None = None,
         state_dir: str | Path | None = None, prefetch: bool = False,
         to: str | None = None) -> dict[str, Any]:
    """Let a parked sandbox run again (``prefetch``: its memory read back from swap now);
    with ``to``, a parked VM moves to that cluster node (or ``local``) with its files and
    thaws there, keeping its id: the result's ``id`` is where it now is (run/migrate.py)."""
    src = target(sandbox_id, node, state_dir)
    if to is None:
        return src.thaw(sandbox_id, prefetch)
    _no_prefetch_with_to(prefetch)
    return thaw_to(src, sandbox_id, to, state_dir)


def _no_prefetch_with_to(prefetch: bool) -> None:
    if prefetch:
        raise UsageError("--prefetch does not go with --to: a VM thawed from its state file "
                         "has all its memory loaded")


def receive_moved(sandbox_id: str, stream: Any, state_dir: str | Path | None = None) -> None:
    """This node's receiving end of a move: a parked VM's files read as a tar stream."""
    from ..run.migrate import receive
    receive(local_node(state_dir), sandbox_id, stream)


def thaw_to(src: NodeAPI, sandbox_id: str, to: str, state_dir: str | Path | None = None
            ) -> dict[str, Any]:
    """Move a parked VM from node ``src`` to node ``to`` and thaw it there."""
    validate.node_option(to, "--to")
    if to == "auto":
        raise UsageError("--to names a node: auto is not allowed")
    dst = target(None, to, state_dir)
    if getattr(src, "name", "local") == getattr(dst, "name", "local"):
        raise UsageError(f"sandbox {sandbox_id} is already on node {to}",
                         hint=f"dsec thaw {sandbox_id}")
    from ..run.migrate import move

    return move(src, dst, sandbox_id)


def top(state_dir: str | Path | None = None, node: str | None = None,
        interval: float = 0.0) -> list[dict[str, Any]]:
    """Per sandbox of one node: CPU (a fraction of one CPU over ``interval`` seconds),
    resident, reclaimed and swapped bytes, class and idle seconds."""
    return target(None, node, state_dir).top(interval)


def fork(sandbox_id: str, n: int, node: str | None = None,
         state_dir: str | Path | None = None) -> dict[str, Any]:
    """``n`` copies of a sandbox's files (`Sandbox.fork`); ``copies`` holds their records."""
    check_count(n)
    return target(sandbox_id, node, state_dir).fork(sandbox_id, n)


def drop_connections() -> None:
    """Close the connections to sandboxes this process keeps open for later calls (a
    long-lived process serving short commands calls it between them: a VM's agent takes one
    connection at a time)."""
    drop_node_connections()
