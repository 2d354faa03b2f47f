"""Forks: ``n`` new sandboxes that start from one sandbox's current files (`dsec fork`).

Where the backend can snapshot (container, microvm, vm), the sandbox's writable diff is
snapshotted once into a layer (`snapshot.py`: paused while it is read) and every copy is
created from the image stacking it: the layer is materialized once in the node's layer cache
and is a read-only lower layer of each copy, which writes into its own upper dir
(copy-on-write). Writes of one copy are seen neither by the others nor by the parent.

An `fncall` sandbox has nothing to snapshot: its root is the image, read-only, and only its
/tmp (a tmpfs in memory) is writable. Its copies are new sandboxes of the same image whose
/tmp is filled with the parent's (regular files, directories and symlinks), read once.

Only files are copied, never processes: a copy starts with a fresh init, as after a restart.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import SandboxError, UsageError
from .options import CreateOptions

if TYPE_CHECKING:
    from .node import Node
    from .state import SandboxRecord

#: bytes of an fncall sandbox's /tmp a fork copies at most (they are held in memory once)
MAX_TMP_BYTES = 1 << 30
#: copies made by one fork at most (a typo like `-n 10000` should not fill a node)
MAX_FORKS = 256


def check_count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORKS:
        raise UsageError(f"invalid fork count {n!r}: must be a whole number from 1 to "
                         f"{MAX_FORKS}")
    return n


def copy_options(rec: SandboxRecord) -> CreateOptions:
    """The options a sandbox was created with, read back from its record."""
    spec = rec.spec
    lim = spec.get("limits", {})
    ttl = rec.expires - rec.created if rec.expires else None
    return CreateOptions(backend=rec.backend, cpus=lim.get("cpus"), memory=lim.get("memory"),
                         pids=lim.get("pids"), disk=lim.get("disk"), ttl=ttl,
                         network=spec.get("network", "none"), env=dict(spec.get("env", {})),
                         workdir=spec.get("workdir") or None)


def fork(node: Node, sid: str, n: int) -> dict[str, Any]:
    """Make ``n`` copies of sandbox ``sid``'s files; returns the copies' records and, for
    snapshotting backends, the shared layer (``image``, ``layer_digest``)."""
    check_count(n)
    rec = node.lookup(sid)
    if rec.status not in ("running", "paused"):
        raise UsageError(f"sandbox {rec.id} is {rec.status}: only a live sandbox can be forked")
    backend = node.backend(rec.backend)
    opts = copy_options(rec)
    out: dict[str, Any] = {"sandbox": rec.id, "backend": rec.backend}
    if backend.fork_mode == "tmp":
        tmp = _TmpTree.read(node, rec.id) if rec.status == "running" else None
        if tmp is None:
            raise UsageError(f"sandbox {rec.id} is paused: resume it to fork it (an fncall "
                             "sandbox's files are read through its agent)")
        copies = _create(node, rec.image, opts, n, tmp.write)
        out.update(image=rec.image, shared="image", copies=copies)
        return out
    if not backend.supports_snapshot:
        raise UsageError(f"the {rec.backend} backend cannot snapshot a sandbox, so it cannot "
                         "fork one")
    if not rec.spec.get("from_store"):
        raise UsageError(f"sandbox {rec.id} runs a directory image: only sandboxes of store "
                         "images can be forked (their diff becomes a store layer)")
    ref = f"fork-{rec.id}@{time.strftime('%Y%m%d%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    snap = node.snapshot(rec.id, ref)
    copies = _create(node, snap["image"], opts, n, None)
    out.update(image=snap["image"], image_digest=snap["image_digest"],
               layer_digest=snap["layer_digest"], shared="layer", copies=copies)
    return out


def _create(node: Node, image: str, opts: CreateOptions, n: int,
            seed: Any) -> list[SandboxRecord]:
    """All ``n`` copies or none: a copy that fails removes the ones made before it."""
    made: list[SandboxRecord] = []
    try:
        for _ in range(n):
            r = node.create(image, opts)
            made.append(r)
            if seed is not None:
                seed(node, r.id)
    except BaseException:
        for r in made:
            try:
                node.remove(r.id)
            except Exception:  # keep the first error; reconcile finishes what is left
                pass
        raise
    return made


@dataclass
class _TmpTree:
    """An fncall sandbox's /tmp, read through its agent: directories, symlinks and files."""

    dirs: list[tuple[str, int]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    files: list[tuple[str, int, bytearray]] = field(default_factory=list)

    held: int = 0

    # the TreeSink protocol (backends/base.py); what the sandbox sends is hostile input
    def entry(self, kind: str, mode: int, size: int, rel: bytes, target: bytes) -> None:
        if not rel:
            return  # /tmp itself
        if any(p in (b"", b".", b"..") or b"\0" in p for p in rel.split(b"/")) \
                or b"\0" in target:
            raise SandboxError(f"the sandbox sent a bad name in /tmp: {rel[:200]!r}")
        path = "/tmp/" + rel.decode(errors="surrogateescape")
        if kind == "d":
            self.dirs.append((path, mode & 0o777))
        elif kind == "l":
            self.links.append((path, target.decode(errors="surrogateescape")))
        elif kind == "f":
            self.held += size
            if self.held > MAX_TMP_BYTES:
                raise UsageError(f"the sandbox's /tmp holds over {MAX_TMP_BYTES >> 20} MiB: "
                                 "too much to copy into each fork")
            self.files.append((path, mode & 0o777, bytearray(size)))

    def chunk(self, offset: int, data: memoryview) -> None:
        if not self.files or offset < 0 or offset + len(data) > len(self.files[-1][2]):
            raise SandboxError("the sandbox sent file content past a file's size")
        self.files[-1][2][offset:offset + len(data)] = data

    @classmethod
    def read(cls, node: Node, sid: str) -> _TmpTree:
        tree = cls()
        node.get_tree(sid, "/tmp", tree)
        return tree

    def write(self, node: Node, sid: str) -> None:
        for batch in _batches([p for p, _ in self.dirs]):
            _check(node.exec(sid, ["/bin/mkdir", "-p", "--", *batch]), batch[0])
        for path, mode, data in self.files:
            node.put_file(sid, path, bytes(data), mode)
        for path, target in self.links:
            _check(node.exec(sid, ["/bin/ln", "-s", "--", target, path]), path)
        by_mode: dict[int, list[str]] = {}
        for path, mode in self.dirs:
            by_mode.setdefault(mode, []).append(path)
        for mode, paths in by_mode.items():
            for batch in _batches(paths):
                _check(node.exec(sid, ["/bin/chmod", f"{mode:o}", "--", *batch]), batch[0])


def _batches(paths: list[str], size: int = 256) -> list[list[str]]:
    """Paths in groups small enough for one command line each."""
    return [paths[i:i + size] for i in range(0, len(paths), size)]


def _check(res: Any, path: str) -> None:
    if res.exit_code != 0:
        raise UsageError(f"cannot recreate {path} in a fork: "
                         f"{res.stderr.decode(errors='replace').strip()}")
