"""Sandbox lifecycle on this node: create, exec, cp, pause, resume, snapshot, remove, list,
reconcile and node gc, over any backend.

State lives under one directory (`Config.state_dir`, `DSEC_STATE_DIR`): ``node.db`` (see
state.py), ``sandboxes/<id>/`` (upper dir, mounts, sockets), ``cache/layers/`` (main's layer
cache) and ``runc/`` (runc's own state). Every change is written to the database *before*
anything is made on the system and removed *after* it is torn down, so a crash at any point
leaves rows that reconcile can finish, never resources nobody knows about. Cgroups are named
after a digest of the state dir, so two nodes (or test sessions) on one host never touch each
other's sandboxes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import shutil
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from ..backends import (
    Backend,
    ExecRequest,
    ExecResult,
    Limits,
    OutputCallback,
    RootfsSpec,
    SandboxHandle,
    SandboxSpec,
    TreeSink,
    _cgroups,
    _rootfs,
    get_backend,
)
from ..core.errors import NotFoundError, SandboxError, UsageError
from .state import NodeDB, SandboxRecord, now

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("container", "fncall", "microvm", "vm")
MIN_MEMORY = 8 << 20
MIN_DISK = _rootfs.MIN_DISK
MAX_SIZE = 1 << 60


@dataclass
class CreateOptions:
    backend: str = "container"
    cpus: float | None = None
    memory: int | None = None
    pids: int | None = None
    ttl: float | None = None
    network: Literal["none", "host"] = "none"
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    disk: int | None = None  # bytes the sandbox may write (its upper dir, or /tmp for fncall)
    fetch: str = "eager"  # eager | lazy | background (docs/lazy.md)
    record_seconds: float | None = None  # lazy: profile reads this long (default 30 s)

    def validate(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise UsageError(f"unknown backend {self.backend!r}; choose one of: "
                             f"{', '.join(BACKEND_CHOICES)}")
        ncpu = os.cpu_count() or 1
        if self.cpus is not None and not (0.01 <= self.cpus <= ncpu):
            raise UsageError(f"invalid --cpus {self.cpus}: must be between 0.01 and {ncpu} "
                             "(the CPUs of this node)")
        if self.memory is not None and not MIN_MEMORY <= self.memory <= MAX_SIZE:
            raise UsageError(f"invalid --memory {self.memory}: must be at least 8 MiB and at "
                             "most 1 EiB")
        if self.pids is not None and self.pids < 2:
            raise UsageError(f"invalid --pids {self.pids}: must be at least 2")
        if self.disk is not None and not MIN_DISK <= self.disk <= MAX_SIZE:
            raise UsageError(f"invalid --disk {self.disk}: must be at least 16 MiB and at "
                             "most 1 EiB")
        if self.ttl is not None and not (math.isfinite(self.ttl) and self.ttl > 0):
            raise UsageError(f"invalid --ttl {self.ttl}: must be a finite number of seconds "
                             "above 0")
        if self.network not in ("none", "host"):
            raise UsageError(f"invalid --network {self.network!r}: choose none or host")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise UsageError(f"invalid workdir {self.workdir!r}: must be an absolute path")
        if self.fetch not in ("eager", "lazy", "background"):
            raise UsageError(f"invalid --fetch {self.fetch!r}: choose eager, lazy or background")


@dataclass
class Image:
    ref: str
    digest: str
    lower_dirs: list[Path]
    env: dict[str, str]
    workdir: str
    layer_digests: list[str]  # manifest digests of the layers (empty for a directory image)
    from_store: bool
    lazy_layers: list[dict[str, str]] = field(default_factory=list)  # index, content digest


class Node:
    """One node's sandboxes. Thread-safe; share one per process (see `local_node`)."""

    def __init__(self, state_dir: str | Path | None = None, store: str | None = None) -> None:
        from ..core.config import load_config

        cfg = load_config()
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
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()
        self._cache_bytes: tuple[float, int] = (0.0, 0)

    # -- plumbing ------------------------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                opts: dict[str, Any] = {}
                if name in ("container", "fncall"):
                    opts["cgroup_parent"] = self.cgroup_parent
                    opts["shared_dir"] = str(self.root)
                if name == "container":
                    opts["runc_root"] = str(self.runc_root)
                if name in ("microvm", "vm"):
                    from ..core.config import load_config

                    opts["state_dir"] = str(self.root)  # root images and the probe per node
                    opts["kernel"] = load_config().kernel or None
                b = self._backends[name] = get_backend(name, **opts)
            return b

    def store(self) -> Any:
        from ..push.stores import open_store

        return open_store(self.store_url)

    def resolve_image(self, image: str) -> Image:
        """A store reference (``name@version`` or digest), or a local rootfs directory."""
        p = Path(image)
        if image.startswith(("/", "./", "../")) or (p.is_dir() and "@" not in image):
            if not p.is_dir():
                raise NotFoundError(f"image directory {image} does not exist")
            return Image(image, "dir:" + str(p.resolve()), [p.resolve()], {}, "/", [], False)
        from ..push.materialize import prepare_image

        prepared = prepare_image(self.store(), image, self.cache_root)
        return Image(image, prepared.manifest_digest, list(prepared.lower_dirs),
                     dict(prepared.env), prepared.workdir or "/",
                     [d for d, _ in prepared.image.layers], True)

    def lookup(self, sid: str) -> SandboxRecord:
        if not sid or not all(c.isalnum() or c in "-_" for c in sid):
            raise UsageError(f"invalid sandbox id {sid!r}")
        rec = self.db.get(sid)
        if rec is not None:
            return rec
        found = self.db.find(sid)
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise UsageError(f"sandbox id {sid!r} is ambiguous: "
                             f"{', '.join(r.id for r in found[:5])}")
        raise NotFoundError(f"no sandbox {sid!r} on this node", hint="list them with `dsec ps`")

    def _handle(self, rec: SandboxRecord) -> SandboxHandle:
        return SandboxHandle(rec.id, rec.backend, dict(rec.handle or {}))

    # -- create / remove -----------------------------------------------------------------------
    def create(self, image: str, opts: CreateOptions | None = None) -> SandboxRecord:
        opts = opts or CreateOptions()
        opts.validate()
        backend = self.backend(opts.backend)
        sid = secrets.token_hex(6)
        fetch = self._fetch_mode(opts.fetch, image)
        img = self.resolve_image(image) if fetch == "eager" else self._lazy_image(image, sid)
        limits = Limits(cpus=opts.cpus, memory=opts.memory, pids=opts.pids, disk=opts.disk)
        env = {**img.env, **opts.env}
        workdir = opts.workdir or img.workdir or "/"
        rec = SandboxRecord(
            id=sid, backend=opts.backend, image=image, image_digest=img.digest, status="creating",
            handle=None, created=now(), expires=now() + opts.ttl if opts.ttl else None,
            spec={"limits": {"cpus": opts.cpus, "memory": opts.memory, "pids": opts.pids,
                             "disk": opts.disk},
                  "network": opts.network, "env": env, "workdir": workdir,
                  "layer_digests": img.layer_digests, "from_store": img.from_store,
                  "fetch": fetch},
            owner_pid=os.getpid(), owner_start=_rootfs.proc_start_time(os.getpid()),
            layers=[str(p) for p in img.lower_dirs])
        self.db.insert(rec, [img.digest] if img.from_store else [])
        sdir = self.sandboxes_dir / sid
        if img.from_store:
            self._pin(sid, img.digest)
        spec = SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec(tuple(img.lower_dirs),
                           sdir / "upper", sdir / "work"), state_dir=sdir, env=env,
                           workdir=workdir, limits=limits, network=opts.network,
                           image_digest=img.digest)
        try:
            sdir.mkdir(mode=0o700)
            if os.geteuid() == 0:
                # setuid files and device nodes made inside are inert on the host (without
                # root nothing inside can make a setuid-root file or a device node anyway)
                _rootfs.seal_dir(sdir)
            if fetch != "eager":
                self._mount_lazy(sdir, img, fetch, opts.record_seconds)
            handle = backend.create(spec)
            self.db.update(sid, status="running", handle=handle.state)
        except BaseException:
            self._teardown(SandboxHandle(sid, opts.backend, {}), sdir)
            self._unpin(sid)
            self.db.delete(sid)
            raise
        rec.status, rec.handle = "running", handle.state
        return rec

    def _fallback_state(self, sid: str, backend: str) -> dict[str, Any]:
        """What a backend needs to destroy a sandbox whose handle was never saved."""
        sdir = self.sandboxes_dir / sid
        return {"cgroup": f"{self.cgroup_parent}/{sid}", "runc_root": str(self.runc_root),
                "rootfs": str(sdir / "rootfs"), "state_dir": str(sdir)}

    def _teardown(self, handle: SandboxHandle, sdir: Path) -> None:
        if not handle.state:
            handle.state = self._fallback_state(handle.sandbox_id, handle.backend)
        try:
            self.backend(handle.backend).destroy(handle)
        finally:
            self._unmount_lazy(sdir)
            _rootfs.remove_tree(sdir)

    # -- lazy mounts (docs/lazy.md) ------------------------------------------------------------
    def _fetch_mode(self, fetch: str, image: str) -> str:
        if fetch == "eager" or image.startswith(("/", "./", "../")) or Path(image).is_dir():
            return "eager"
        from .lazy import available

        why = available()
        if why is not None:
            log.warning("--fetch %s is not possible here (%s): fetching eagerly", fetch, why)
            return "eager"
        return fetch

    def _lazy_image(self, image: str, sid: str) -> Image:
        from ..push.materialize import LayerCache, resolve_image

        store = self.store()
        img = resolve_image(store, image)
        mnt = self.sandboxes_dir / sid / "lazy" / "mnt"
        # layers are named by the content digest this node computed, never by a claim
        cache = LayerCache(self.cache_root)
        return Image(image, img.digest, [mnt / str(n) for n in range(len(img.layers))],
                     dict(img.env), img.workdir or "/", [d for d, _ in img.layers], True,
                     [{"index": m.index or "", "content_digest": cache.verify(store, m, d)[0]}
                      for d, m in img.layers])

    def _mount_lazy(self, sdir: Path, img: Image, fetch: str, record: float | None) -> None:
        from ..core.config import parse_size
        from .lazy import mount_layers

        mount_layers(sdir / "lazy", self.store_url, img.lazy_layers,
                     cache=self.cache_root / "chunks",
                     budget=parse_size(self.cache_budget, "cache budget"), mode=fetch,
                     record_seconds=record if record is not None else 30.0)

    def _unmount_lazy(self, sdir: Path) -> None:
        state = sdir / "lazy"
        if not state.is_dir():
            return
        from .lazy.mount import cleanup, save_profile

        cleanup(state)
        save_profile(state, self.cache_root / "profiles", sdir.name)

    # -- node facts ------------------------------------------------------------------------------
    def info(self, image: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Version, hostname, store, state dir and cached bytes; with ``image``, how many of
        its bytes the layer cache holds (``image``), or why this node cannot use it
        (``image_error``, the error in wire form). ``timeout`` is for remote nodes."""
        import socket

        from .. import __version__
        from .cluster.protocol import error_to_wire

        out: dict[str, Any] = {"dsec": __version__, "hostname": socket.gethostname(),
                               "store": self.store_url, "state_dir": str(self.root),
                               "cache_bytes": self._cached_total()}
        if image:
            try:
                out["image"] = self.image_cache(image)
            except Exception as e:  # the node cannot see the image: it cannot run it either
                out["image_error"] = error_to_wire(e)
        return out

    def _cached_total(self) -> int:
        """Bytes of the layer cache; walked at most every 30 s (a walk reads every inode)."""
        import time

        t, size = self._cache_bytes
        if time.monotonic() - t > 30:
            from ..push.materialize import LayerCache

            size = sum(s for _, _, s in LayerCache(self.cache_root).entries())
            self._cache_bytes = (time.monotonic(), size)
        return size

    def image_cache(self, image: str) -> dict[str, Any]:
        """How many of an image's bytes this node's layer cache already holds."""
        from ..push.materialize import LayerCache, resolve_image

        if image.startswith("/"):
            return {"bytes": 0, "cached_bytes": 0}
        img = resolve_image(self.store(), image)
        cache = LayerCache(self.cache_root)
        total = sum(m.size for _, m in img.layers)
        cached = sum(m.size for _, m in img.layers if cache.path(m).is_dir())
        return {"bytes": total, "cached_bytes": cached, "digest": img.digest}

    def fetch_stats(self, rec: SandboxRecord) -> dict[str, Any] | None:
        """Bytes fetched and served from cache, stall time: a lazily fetched sandbox's
        figures (None for eager ones)."""
        if rec.spec.get("fetch", "eager") == "eager":
            return None
        from .lazy import read_stats

        return read_stats(self.sandboxes_dir / rec.id / "lazy")

    def remove(self, sid: str) -> SandboxRecord:
        rec = self.lookup(sid)
        self._teardown(self._handle(rec), self.sandboxes_dir / rec.id)
        if rec.spec.get("from_store"):
            self._unpin(rec.id)
        self.db.delete(rec.id)
        if not self.db.all():
            # the node's parent groups go with its last sandbox (a concurrent create that
            # needs them again recreates them; rmdir fails while any child exists)
            _cgroups.Cgroup(self.cgroup_parent).remove_if_empty()
        return rec

    # -- store pins: store gc keeps what running sandboxes use (push/gc.py reads pins/) ------
    def _pin_key(self, sid: str) -> str:
        return f"pins/{self.cgroup_parent}-{sid}"

    def _pin(self, sid: str, digest: str) -> None:
        import json
        import socket

        doc = {"manifest": digest, "sandbox": sid, "node": socket.gethostname(),
               "state_dir": str(self.root), "created": now()}
        try:
            self.store().put(self._pin_key(sid), json.dumps(doc).encode())
        except Exception as e:  # the store may be read-only or away: running matters more
            log.warning("could not pin %s for sandbox %s: %s", digest[:12], sid, e)

    def _unpin(self, sid: str) -> None:
        try:
            self.store().delete(self._pin_key(sid))
        except Exception as e:
            log.warning("could not release the pin of sandbox %s: %s", sid, e)

    # -- work inside ---------------------------------------------------------------------------
    def _live(self, sid: str) -> tuple[SandboxRecord, Backend, SandboxHandle]:
        rec = self.lookup(sid)
        if rec.status == "creating":
            raise UsageError(f"sandbox {rec.id} is still being created")
        if rec.status == "paused":
            raise UsageError(f"sandbox {rec.id} is paused", hint=f"dsec resume {rec.id}")
        b, h = self.backend(rec.backend), self._handle(rec)
        if rec.status == "dead" or not b.is_alive(h):
            if rec.status != "dead":
                self.db.update(rec.id, status="dead")
            raise SandboxError(f"sandbox {rec.id} is no longer running",
                               hint=f"remove it with `dsec rm {rec.id}`")
        return rec, b, h

    def exec(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | Iterable[bytes] | None = None,
             timeout: float | None = None, on_output: OutputCallback | None = None,
             capture_limit: int | None = None) -> ExecResult:
        """Run argv in the sandbox. Output goes to `on_output` as it arrives and is kept in
        the result up to `capture_limit` bytes per stream (None: all of it)."""
        if not argv:
            raise UsageError("exec needs a command")
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise UsageError(f"invalid timeout {timeout}: must be a finite number of seconds "
                             "above 0")
        _, b, h = self._live(sid)
        req = ExecRequest(list(argv), dict(env or {}), cwd, stdin, timeout,  # type: ignore[arg-type]
                          capture_limit)
        return b.exec(h, req, on_output)

    def put_file(self, sid: str, path: str, data: bytes, mode: int = 0o644) -> None:
        _, b, h = self._live(sid)
        b.put_file(h, _sandbox_path(path), data, mode)

    def get_file(self, sid: str, path: str) -> bytes:
        _, b, h = self._live(sid)
        return b.get_file(h, _sandbox_path(path))

    def put_stream(self, sid: str, path: str, src: BinaryIO, mode: int = 0o644) -> int:
        """Write a host file into the sandbox, streamed; its size."""
        _, b, h = self._live(sid)
        return b.put_stream(h, _sandbox_path(path), src, mode)

    def get_tree(self, sid: str, path: str, sink: TreeSink) -> None:
        """Copy a file, symlink or directory out of the sandbox into `sink`, streamed."""
        _, b, h = self._live(sid)
        b.get_tree(h, _sandbox_path(path), sink)

    def get_file_with_mode(self, sid: str, path: str) -> tuple[bytes, int]:
        _, b, h = self._live(sid)
        client = getattr(b, "client", None)
        if client is None:
            return b.get_file(h, _sandbox_path(path)), 0o644
        result: tuple[bytes, int] = client(h).get_file_with_mode(_sandbox_path(path))
        return result

    # -- pause / resume / snapshot -------------------------------------------------------------
    def pause(self, sid: str) -> SandboxRecord:
        rec, b, h = self._live(sid)
        b.pause(h)
        self.db.update(rec.id, status="paused")
        rec.status = "paused"
        return rec

    def resume(self, sid: str) -> SandboxRecord:
        rec = self.lookup(sid)
        if rec.status != "paused":
            raise UsageError(f"sandbox {rec.id} is not paused (it is {rec.status})")
        self.backend(rec.backend).resume(self._handle(rec))
        self.db.update(rec.id, status="running")
        rec.status = "running"
        return rec

    def snapshot(self, sid: str, ref: str, push: str | None = None) -> dict[str, Any]:
        """The sandbox's writable diff becomes layer ``NAME-layer@VERSION`` and image
        ``NAME@VERSION`` (the original's layers plus the new one)."""
        from ..core.digests import parse_ref

        name, version = _parse_snapshot_ref(ref, parse_ref)
        rec = self.lookup(sid)
        if not rec.spec.get("from_store"):
            raise UsageError(f"sandbox {rec.id} runs a directory image: only sandboxes of store "
                             "images can be snapshotted")
        b, h = self.backend(rec.backend), self._handle(rec)
        was_running = rec.status == "running" and b.is_alive(h)
        if was_running:
            b.pause(h)  # a consistent diff: nothing writes while it is read
        try:
            upper = b.snapshot_diff(h)
            from ..build.image import write_image
            from ..build.layer import build_layer_from_dir
            from ..format.tree import ScanReport

            st = self.store()
            base = list(rec.spec.get("layer_digests", []))
            scan_report = ScanReport()
            layer_digest, _ = build_layer_from_dir(
                st, upper, f"{name}-layer", version, base=base,
                created_by=f"dsec snapshot {rec.id}", snapshot=scan_report)
            image_digest, _ = write_image(
                st, name, version, [*base, layer_digest], env=rec.spec.get("env", {}),
                workdir=rec.spec.get("workdir", ""), set_ref_too=True,
                created_by=f"dsec snapshot {rec.id}")
        finally:
            if was_running:
                b.resume(h)
        out: dict[str, Any] = {"sandbox": rec.id, "image": f"{name}@{version}",
                               "image_digest": image_digest, "layer": f"{name}-layer@{version}",
                               "layer_digest": layer_digest,
                               "warnings": scan_report.warnings()}
        if push:
            out["pushed"] = _push(st, [f"{name}-layer@{version}", f"{name}@{version}"], push)
        return out

    # -- listing, reconcile, gc ----------------------------------------------------------------
    def sandboxes(self, reconcile: bool = True) -> list[SandboxRecord]:
        if reconcile:
            self.reconcile()
        return self.db.all()

    def reconcile(self) -> dict[str, list[str]]:
        """Make the database and the system agree after crashes: finish half-done creates,
        mark dead sandboxes, remove mounts, dirs, cgroups and runc state nobody owns."""
        report: dict[str, list[str]] = {"aborted": [], "dead": [], "orphans": []}
        # list the system first, then read rows: a row is written before its resources exist
        dirs = {p.name for p in self.sandboxes_dir.iterdir()} if self.sandboxes_dir.is_dir() \
            else set()
        groups = _cgroups.children(self.cgroup_parent)
        runc = {p.name for p in self.runc_root.iterdir()} if self.runc_root.is_dir() else set()
        rows = {r.id: r for r in self.db.all()}
        for r in rows.values():
            if r.status == "creating":
                if not _rootfs.alive(r.owner_pid, r.owner_start):
                    self._teardown(SandboxHandle(r.id, r.backend, dict(r.handle or {})),
                                   self.sandboxes_dir / r.id)
                    if r.spec.get("from_store"):
                        self._unpin(r.id)
                    self.db.delete(r.id)
                    report["aborted"].append(r.id)
            elif r.status in ("running", "paused"):
                if not self.backend(r.backend).is_alive(self._handle(r)):
                    self.db.update(r.id, status="dead")
                    report["dead"].append(r.id)
        for sid in (dirs | groups | runc) - set(rows):
            if sid.startswith("."):
                continue
            _cgroups.Cgroup(f"{self.cgroup_parent}/{sid}").remove()
            shutil.rmtree(self.runc_root / sid, ignore_errors=True)
            self._unmount_lazy(self.sandboxes_dir / sid)
            _rootfs.remove_tree(self.sandboxes_dir / sid)
            report["orphans"].append(sid)
        return report

    def gc(self, budget: int | None = None, dry_run: bool = False) -> dict[str, Any]:
        """Remove expired and dead sandboxes, then evict unleased cached layers, least
        recently used first, until the cache fits the budget."""
        from ..core.config import parse_size

        report: dict[str, Any] = {"removed": [], "evicted": [], "freed_bytes": 0}
        if not dry_run:
            report.update(self.reconcile())
        from ..build.steps import clean_stale_staging
        from ..core.config import load_config

        # staging dirs (and overlay mounts) of builds killed during a `run` step
        report["stale_builds"] = clean_stale_staging(Path(load_config().data_dir) / "tmp",
                                                     dry_run=dry_run)
        t = now()
        for r in self.db.all():
            expired = r.expires is not None and r.expires <= t
            if expired or r.status == "dead":
                report["removed"].append({"id": r.id, "reason": "expired" if expired else "dead"})
                if not dry_run:
                    try:
                        self.remove(r.id)
                    except NotFoundError:
                        pass  # removed concurrently
        budget = budget if budget is not None else parse_size(self.cache_budget, "cache budget")
        from ..push.materialize import LayerCache

        cache = LayerCache(self.cache_root)
        entries = sorted(cache.entries(), key=lambda e: e[1])  # oldest use first
        total = sum(size for _, _, size in entries)
        leased = self.db.leased_layers()
        for path, _, size in entries:
            if total <= budget:
                break
            if str(path) in leased:
                continue
            report["evicted"].append(path.name)
            report["freed_bytes"] += size
            total -= size
            if not dry_run:
                tmp = path.with_name(f".tmp-evict-{path.name[:16]}-{secrets.token_hex(4)}")
                try:
                    os.rename(path, tmp)  # atomic: a concurrent create re-materializes it
                except OSError:
                    continue
                shutil.rmtree(tmp, ignore_errors=True)
        report["cache_bytes"] = total
        if not dry_run and not self.db.all():
            _cgroups.Cgroup(self.cgroup_parent).remove_if_empty()
        return report

    def describe(self, sid: str) -> dict[str, Any]:
        rec = self.lookup(sid)
        out = rec.public()
        if rec.status in ("running", "paused"):
            out.update(self.backend(rec.backend).describe(self._handle(rec)))
        stats = self.fetch_stats(rec)
        if stats is not None:
            out["fetch"] = stats
        return out


def _sandbox_path(path: str) -> str:
    """Paths inside a sandbox are absolute; the agent resolves them in the sandbox's own
    root, so `..` and symlinks cannot leave it."""
    if not path.startswith("/"):
        raise UsageError(f"sandbox path {path!r} must be absolute")
    if "\0" in path:
        raise UsageError("sandbox paths may not contain NUL")
    return path


def _parse_snapshot_ref(ref: str, parse_ref: Any) -> tuple[str, str]:
    try:
        name, version = parse_ref(ref)
    except Exception as e:
        raise UsageError(f"invalid snapshot name {ref!r}: expected NAME@VERSION ({e})") from e
    return name, version


def _push(store: Any, refs: list[str], url: str) -> Any:
    """Copy a snapshot's refs to another store (what `dsec snapshot --push URL` does)."""
    from ..push.retry import open_retrying
    from ..push.transfer import copy_refs

    with open_retrying(url) as dst:
        report = copy_refs(store, dst, refs)
    return report.to_dict()


_nodes: dict[str, Node] = {}
_nodes_lock = threading.Lock()


def local_node(state_dir: str | Path | None = None, store: str | None = None) -> Node:
    """The process-wide Node for a state dir (shared so agent connections stay warm)."""
    from ..core.config import load_config

    key = str(Path(state_dir or load_config().state_dir).absolute()) + "|" + (store or "")
    with _nodes_lock:
        n = _nodes.get(key)
        if n is None:
            n = _nodes[key] = Node(state_dir, store)
        return n
