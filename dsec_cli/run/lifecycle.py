"""A node's sandbox lifecycle core (`NodeCore`): state, backends, create-now, lookup,
exec and files, pause, resume, remove and teardown, over any backend.

State lives under one directory (`Config.state_dir`, `DSEC_STATE_DIR`): ``node.db`` (see
state.py), ``sandboxes/<id>/`` (upper dir, mounts, sockets), ``cache/layers/`` (main's layer
cache) and ``runc/`` (runc's own state). Every change is written to the database *before*
anything is made on the system and removed *after* it is torn down, so a crash at any point
leaves rows that reconcile can finish, never resources nobody knows about. Cgroups are named
after a digest of the state dir, so two nodes (or test sessions) on one host never touch each
other's sandboxes.

What composes this core (warm pools, density, fork, moves, snapshots, reconcile) is
`run.node.Node`; the modules that do it (pool.py, density.py, ...) need only this core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .. import __version__
from ..backends import (
    Backend,
    BackendContext,
    ExecRequest,
    ExecResult,
    Limits,
    OutputCallback,
    RootfsSpec,
    SandboxHandle,
    SandboxSpec,
    TreeSink,
    UserIds,
    _cgroups,
    _rootfs,
    get_backend,
)
from ..backends.agented import AgentBackend
from ..core.config import debug_delay, load_config
from ..core.errors import NotFoundError, SandboxError, UsageError
from ..oci import runconfig
from . import density, images, pins
from .images import Image
from .options import CreateOptions
from .state import NodeDB, SandboxRecord, now

__all__ = ["NodeCore", "check_exec", "require_root", "sandbox_path"]

log = logging.getLogger(__name__)


def require_root() -> None:
    """Sandboxes mount, make cgroups and namespaces: without root a create would fail half
    way (an unmount refused, a row left in `creating`), so it is refused before anything."""
    if os.geteuid() != 0:
        raise UsageError(f"creating sandboxes needs root (this is uid {os.geteuid()})",
                         hint="run dsec as root, or through sudo; building, pushing and "
                              "reading stores work as any user")


class NodeCore:
    """One node's sandboxes, made and worked in. Thread-safe."""

    def __init__(self, state_dir: str | Path | None = None, store: str | None = None) -> None:
        self.config = cfg = load_config()  # read once per node: what composes it reads it here
        self.root = Path(state_dir or cfg.state_dir).absolute()
        self.store_url = store or cfg.store
        self.cache_budget = cfg.cache_budget
        self.sandboxes_dir = self.root / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        # sandbox state (upper dirs a sandbox's root writes into, agent sockets) is for root
        # alone: no other host user may traverse into it
        for d in (self.root, self.sandboxes_dir):
            if d.stat().st_mode & 0o077:
                d.chmod(0o700)
        self.cache_root = self.root / "cache"
        self.runc_root = self.root / "runc"
        self.db = NodeDB(self.root / "node.db")
        self.cgroup_parent = "dsec-" + hashlib.sha256(str(self.root).encode()).hexdigest()[:10]
        self.backend_context = BackendContext(self.root, self.cgroup_parent, self.runc_root,
                                              cfg.kernel or None)
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()
        self._thread = threading.local()
        self._cache_bytes: tuple[float, int] = (0.0, 0)

    # -- plumbing ------------------------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                b = self._backends[name] = get_backend(name, self.backend_context)
            return b

    def store(self) -> Any:
        from ..push.stores import open_store

        return open_store(self.store_url)

    def resolve_image(self, image: str) -> Image:
        """A store reference (``name@version`` or digest), or a local rootfs directory."""
        return images.resolve(self.store(), self.cache_root, image)

    def lookup(self, sid: str, *, pooled: bool = False) -> SandboxRecord:
        """The sandbox with this id (or unique id prefix). Warm pool members are nobody's
        sandboxes yet: only ``pooled=True`` (removal) finds them."""
        if not sid or not all(c.isalnum() or c in "-_" for c in sid):
            raise UsageError(f"invalid sandbox id {sid!r}")
        rec = self.db.get(sid)
        if rec is not None and (pooled or rec.status != "pooled"):
            return rec
        found = [r for r in self.db.find(sid) if r.status != "pooled"]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise UsageError(f"sandbox id {sid!r} is ambiguous: "
                             f"{', '.join(r.id for r in found[:5])}")
        raise NotFoundError(f"no sandbox {sid!r} on this node", hint="list them with `dsec ps`")

    def handle_of(self, rec: SandboxRecord) -> SandboxHandle:
        return SandboxHandle(rec.id, rec.backend, dict(rec.handle or {}))

    def image_digest(self, image: str) -> str:
        """The manifest digest a store reference names now: one small read of the store
        (through a store opened once per thread), nothing materialized."""
        from ..format.refs import resolve

        store = getattr(self._thread, "store", None)
        if store is None:
            store = self._thread.store = self.store()
        return resolve(store, image)

    def make(self, image: str, img: Image | None, opts: CreateOptions, fetch: str,
             pool_key: str | None = None, sid: str | None = None) -> SandboxRecord:
        """Create one sandbox now, from ``img`` (None: resolved here, eagerly or lazily as
        ``fetch`` says); with ``pool_key`` it becomes a warm pool member (status ``pooled``)
        instead of a running sandbox. `Node.create` takes a pool member first."""
        backend = self.backend(opts.backend)
        sid = sid or secrets.token_hex(6)
        if img is None:
            img = self.resolve_image(image) if fetch == "eager" else \
                images.lazy(self.store(), self.cache_root, self.sandboxes_dir / sid, image)
        limits = Limits(**opts.limits())
        env = {**img.env, **opts.env}
        workdir = opts.workdir or img.workdir or "/"
        spec_row: dict[str, Any] = {
            "limits": opts.limits(),
            "network": opts.network, "env": env, "workdir": workdir,
            "layer_digests": img.layer_digests, "from_store": img.from_store, "fetch": fetch,
            **runconfig.image_command(img.annotations)}
        if pool_key is not None:
            spec_row["pool"] = pool_key
        rec = SandboxRecord(
            id=sid, backend=opts.backend, image=image, image_digest=img.digest, status="creating",
            handle=None, created=now(), expires=now() + opts.ttl if opts.ttl else None,
            spec=spec_row, owner_pid=os.getpid(), owner_start=_rootfs.proc_start_time(os.getpid()),
            layers=[str(p) for p in img.lower_dirs])
        self.db.insert(rec, [img.digest] if img.from_store else [])
        sdir = self.sandboxes_dir / sid
        if img.from_store:
            pins.pin(self.store(), self.cgroup_parent, self.root, sid, img.digest)
        spec = SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec(tuple(img.lower_dirs),
                           sdir / "upper", sdir / "work"), state_dir=sdir, env=env,
                           workdir=workdir, limits=limits, network=opts.network,
                           egress=tuple(opts.egress),
                           image_digest=img.digest)
        status = "running" if pool_key is None else "pooled"
        try:
            sdir.mkdir(mode=0o700)
            if os.geteuid() == 0:
                # setuid files and device nodes made inside are inert on the host (without
                # root nothing inside can make a setuid-root file or a device node anyway)
                _rootfs.seal_dir(sdir)
            if fetch != "eager":
                images.mount_lazy(sdir, self.store_url, img, fetch, self.cache_root,
                                   self.cache_budget, opts.record_seconds)
            user = self._sandbox_user(img, opts)
            if user is not None:
                if user.home and "HOME" not in env:
                    env = {**env, "HOME": user.home}
                spec = dataclasses.replace(spec, env=env, user=user.ids)
            handle = backend.create(spec)
            if user is not None:
                handle.state["user"] = user.ids.to_json()
            if pool_key is not None:
                pause = debug_delay("pool_refill")  # tests stop a refill here and kill it
                if pause:
                    time.sleep(pause)
            self.db.update(sid, status=status, handle=handle.state)
        except BaseException:
            self.teardown(SandboxHandle(sid, opts.backend, {}), sdir)
            pins.unpin(self.store, self.cgroup_parent, sid)
            self.db.delete(sid)
            raise
        rec.status, rec.handle = status, handle.state
        return rec

    @staticmethod
    def _sandbox_user(img: Image, opts: CreateOptions) -> runconfig.ResolvedUser | None:
        """The user commands run as by default: ``opts.user``, else the image's, resolved
        against the image's own files; None for root."""
        spec = opts.user if opts.user is not None else img.annotations.get("oci.user", "")
        if not spec:
            return None
        return runconfig.resolve_user(spec, list(reversed(img.lower_dirs)))

    def exec_user(self, rec: SandboxRecord, user: str | None) -> UserIds | None:
        """Who an exec runs as: ``user`` resolved against the sandbox's files (its writes
        over its image's layers), else the sandbox's user."""
        if user is None:
            doc = (rec.handle or {}).get("user")
            return UserIds.from_json(doc) if doc else None
        layers = [self.sandboxes_dir / rec.id / "upper", *reversed([Path(p) for p in rec.layers])]
        return runconfig.resolve_user(user, layers).ids

    def _fallback_state(self, sid: str, backend: str) -> dict[str, Any]:
        """What a backend needs to destroy a sandbox whose handle was never saved."""
        sdir = self.sandboxes_dir / sid
        return {"cgroup": f"{self.cgroup_parent}/{sid}", "runc_root": str(self.runc_root),
                "rootfs": str(sdir / "rootfs"), "state_dir": str(sdir)}

    def teardown(self, handle: SandboxHandle, sdir: Path) -> None:
        if not handle.state:
            handle.state = self._fallback_state(handle.sandbox_id, handle.backend)
        try:
            self.backend(handle.backend).destroy(handle)
        finally:
            images.unmount_lazy(sdir, self.cache_root)
            _rootfs.remove_tree(sdir)

    # -- node facts ------------------------------------------------------------------------------
    def info(self, image: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Version, hostname, store, state dir and cached bytes; with ``image``, how many of
        its bytes the layer cache holds (``image``), or why this node cannot use it
        (``image_error``, the error in wire form). ``timeout`` is for remote nodes."""
        from .cluster.protocol import error_to_wire  # the node service's wire form

        out: dict[str, Any] = {"dsec": __version__, "hostname": socket.gethostname(),
                               "store": self.store_url, "state_dir": str(self.root),
                               "cache_bytes": self._cached_total(),
                               "fetch": images.fetch_report(self.store_url)}
        if image:
            try:
                out["image"] = self.image_cache(image)
            except Exception as e:  # the node cannot see the image: it cannot run it either
                out["image_error"] = error_to_wire(e)
        return out

    def _cached_total(self) -> int:
        """Bytes of the layer cache; walked at most every 30 s (a walk reads every inode)."""
        t, size = self._cache_bytes
        if time.monotonic() - t > 30:
            from ..push.materialize import LayerCache

            size = sum(s for _, _, s in LayerCache(self.cache_root).entries())
            self._cache_bytes = (time.monotonic(), size)
        return size

    def image_cache(self, image: str) -> dict[str, Any]:
        """How many of an image's bytes this node's layer cache already holds."""
        return images.cache_usage(self.store(), self.cache_root, image)

    def fetch_stats(self, rec: SandboxRecord) -> dict[str, Any] | None:
        """Bytes fetched and served from cache, stall time: a lazily fetched sandbox's
        figures (None for eager ones)."""
        if rec.spec.get("fetch", "eager") == "eager":
            return None
        from .lazy import read_stats

        return read_stats(self.sandboxes_dir / rec.id / "lazy")

    def remove(self, sid: str) -> SandboxRecord:
        rec = self.lookup(sid, pooled=True)
        self.teardown(self.handle_of(rec), self.sandboxes_dir / rec.id)
        if rec.spec.get("from_store"):
            pins.unpin(self.store, self.cgroup_parent, rec.id)
        self.db.delete(rec.id)
        if not self.db.all():
            # the node's parent groups go with its last sandbox (a concurrent create that
            # needs them again recreates them; rmdir fails while any child exists)
            _cgroups.Cgroup(self.cgroup_parent).remove_if_empty()
        return rec

    # -- work inside ---------------------------------------------------------------------------
    def live(self, sid: str) -> tuple[SandboxRecord, Backend, SandboxHandle]:
        """A running sandbox's record, backend and handle (`UsageError` while it is being
        created or is paused, `SandboxError` once it died)."""
        rec = self.lookup(sid)
        if rec.status == "creating":
            raise UsageError(f"sandbox {rec.id} is still being created")
        if rec.status == "paused":
            raise UsageError(f"sandbox {rec.id} is paused", hint=f"dsec resume {rec.id}")
        if rec.status == "parked":
            raise UsageError(f"sandbox {rec.id} is parked", hint=f"dsec thaw {rec.id}")
        b, h = self.backend(rec.backend), self.handle_of(rec)
        if rec.status == "dead" or not b.is_alive(h):
            if rec.status != "dead":
                self.db.update(rec.id, status="dead")
            raise SandboxError(f"sandbox {rec.id} is no longer running",
                               hint=f"remove it with `dsec rm {rec.id}`")
        return rec, b, h

    def exec(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | Iterable[bytes] | None = None,
             timeout: float | None = None, on_output: OutputCallback | None = None,
             capture_limit: int | None = None, user: str | None = None) -> ExecResult:
        """Run argv in the sandbox. Output goes to `on_output` as it arrives and is kept in
        the result up to `capture_limit` bytes per stream (None: all of it). ``user``
        (NAME, UID, NAME:GROUP, UID:GID) overrides the sandbox's user."""
        check_exec(argv, timeout)
        rec, b, h = self.live(sid)
        req = ExecRequest(list(argv), dict(env or {}), cwd, stdin, timeout,  # type: ignore[arg-type]
                          capture_limit, self.exec_user(rec, user))
        with self.working(rec.id):
            return b.exec(h, req, on_output)

    @contextlib.contextmanager
    def working(self, sid: str) -> Iterator[None]:
        """Around work in a sandbox (an exec, from a thread or an event loop): its idle time
        (`dsec top`, idle reclaim) counts from the start and the end of the last one."""
        sdir = self.sandboxes_dir / sid
        density.touch(sdir)
        try:
            yield
        finally:
            density.touch(sdir)

    def put_file(self, sid: str, path: str, data: bytes, mode: int = 0o644,
                 user: str | None = None) -> None:
        """Create or truncate a file (and its missing parents) and write `data`, as the
        sandbox's user (``user``, as exec takes it, overrides): permissions apply, and the
        file and the directories made are that user's."""
        rec, b, h = self.live(sid)
        b.put_file(h, sandbox_path(path), data, mode, self.exec_user(rec, user))

    def get_file(self, sid: str, path: str, user: str | None = None) -> bytes:
        """A regular file's content, read as the sandbox's user (or ``user``)."""
        return self.get_file_with_mode(sid, path, user)[0]

    def put_stream(self, sid: str, path: str, src: BinaryIO, mode: int = 0o644) -> int:
        """Write a host file into the sandbox, streamed; its size."""
        _, b, h = self.live(sid)
        return b.put_stream(h, sandbox_path(path), src, mode)

    def get_tree(self, sid: str, path: str, sink: TreeSink) -> None:
        """Copy a file, symlink or directory out of the sandbox into `sink`, streamed."""
        _, b, h = self.live(sid)
        b.get_tree(h, sandbox_path(path), sink)

    def get_file_with_mode(self, sid: str, path: str, user: str | None = None
                           ) -> tuple[bytes, int]:
        rec, b, h = self.live(sid)
        ids = self.exec_user(rec, user)
        if not isinstance(b, AgentBackend):
            return b.get_file(h, sandbox_path(path), ids), 0o644
        return b.get_file_with_mode(h, sandbox_path(path), ids)

    # -- pause / resume -----------------------------------------------------------------------
    def pause(self, sid: str) -> SandboxRecord:
        rec, b, h = self.live(sid)
        b.pause(h)
        self.db.update(rec.id, status="paused")
        rec.status = "paused"
        return rec

    def resume(self, sid: str) -> SandboxRecord:
        rec = self.lookup(sid)
        if rec.status != "paused":
            raise UsageError(f"sandbox {rec.id} is not paused (it is {rec.status})",
                             hint=f"dsec thaw {rec.id}" if rec.status == "parked" else None)
        self.backend(rec.backend).resume(self.handle_of(rec))
        self.db.update(rec.id, status="running")
        rec.status = "running"
        return rec


def check_exec(argv: list[str], timeout: float | None) -> None:
    """An exec's command and timeout, checked before anything is sent."""
    if not argv:
        raise UsageError("exec needs a command")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"invalid timeout {timeout}: must be a finite number of seconds "
                         "above 0")


def sandbox_path(path: str) -> str:
    """Paths inside a sandbox are absolute; the agent resolves them in the sandbox's own
    root, so `..` and symlinks cannot leave it."""
    if not path.startswith("/"):
        raise UsageError(f"sandbox path {path!r} must be absolute")
    if "\0" in path:
        raise UsageError("sandbox paths may not contain NUL")
    return path
