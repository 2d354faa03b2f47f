"""Thaw on another node (`dsec thaw ID --to NODE`): a VM parked to a state file
(backends/vm/vmpark.py) moves with its files and thaws there, keeping its id.

What moves: the state file, the QEMU command line it ran under, the writable disk, and the
read-only root image the guest has been reading (it becomes the sandbox's own copy on the
target: a root image built there from the same layers need not be byte-identical, and the
guest's page cache holds blocks of this one). The target's own kernel, initramfs and QEMU
stand in for the source's (the guest booted long ago: only their devices must match, which
the same dsec install gives).

The steps, each on the node that owns the data:

1. ``park_export`` on the source: the sandbox must be a parked VM with a complete state file
   and no job's journal on that node; where its files are.
2. ``park_incoming`` on the target: an empty ``<state>/incoming/<id>/`` (refused when the
   target already has a sandbox with that id).
3. the client streams the files between them (tar over each node's SSH master; a local end
   runs tar here).
4. ``park_import`` on the target: a ``creating`` row first (as any create), the files moved
   into the sandbox's state dir, the command line pointed at the target's paths, the row
   ``parked``.
5. the source's sandbox removed (never two copies that can run), then ``thaw`` on the target.

A failure before 5 leaves the source as it was (parked) and the target's incoming dir, which
node gc removes after a day. Container and fncall sandboxes do not move: that would need a
checkpoint of their processes (CRIU), which this host cannot take (`dsec node check --host`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import SandboxHandle, _rootfs
from ..core.errors import SandboxError, UsageError
from . import pins
from .density import VM_BACKENDS
from .state import SandboxRecord

if TYPE_CHECKING:
    from .node import Node

FILES = ("park.state", "park.json", "disk.ext4")
ROOT_COPY = "root.erofs"
INCOMING = "incoming"
INCOMING_MAX_AGE = 86400.0
_SID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_IMAGE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}\.erofs")


def _job_of(node: Node, sid: str) -> str | None:
    if not (node.root / "jobs.db").exists():
        return None
    from .jobs import node_jobs

    rows = node_jobs(node).db.q("SELECT job FROM rollouts WHERE sandbox=?", (sid,))
    return str(rows[0]["job"]) if rows else None


def export_parked(node: Node, sid: str) -> dict[str, Any]:
    """Where a parked VM's files are, and what its row holds (step 1)."""
    from ..backends.vm import vmpark

    rec = node.lookup(sid)
    if rec.backend not in VM_BACKENDS:
        raise UsageError(f"{rec.backend} sandbox {rec.id} cannot move to another node: only "
                         "microvm and vm sandboxes are saved to a file when parked",
                         hint="`dsec node check --host` says how each backend parks here")
    h = node.handle_of(rec)
    if rec.status != "parked" or not vmpark.saved(h):
        raise UsageError(f"sandbox {rec.id} is not parked to a state file (it is {rec.status})",
                         hint=f"dsec park {rec.id}")
    if h.state.get("network") == "allowlist":
        raise UsageError(f"sandbox {rec.id} has an egress allowlist, whose network namespace "
                         "and host-side filter are this node's: it cannot move")
    job = _job_of(node, rec.id)
    if job is not None:
        raise UsageError(f"sandbox {rec.id} belongs to job {job}, whose journal is kept on "
                         "this node: it cannot move")
    root = Path(str(h.state.get("root_image", "")))
    if not root.is_file():
        raise SandboxError(f"the root image of sandbox {rec.id} is gone ({root})")
    return {"record": {"id": rec.id, "backend": rec.backend, "image": rec.image,
                       "image_digest": rec.image_digest, "spec": rec.spec,
                       "created": rec.created, "expires": rec.expires},
            "handle": h.state, "dir": str(node.sandboxes_dir / rec.id),
            "root_dir": str(root.parent), "root_name": root.name}


def _check_sid(sid: Any) -> str:
    if not isinstance(sid, str) or not _SID.fullmatch(sid):
        raise UsageError(f"invalid sandbox id {sid!r}")
    return sid


def incoming(node: Node, sid: str) -> str:
    """An empty directory for a moving sandbox's files (step 2)."""
    _check_sid(sid)
    if node.db.get(sid) is not None or (node.sandboxes_dir / sid).exists():
        raise UsageError(f"this node already has a sandbox {sid}")
    root = node.root / INCOMING
    root.mkdir(mode=0o700, exist_ok=True)
    clean_incoming(node)
    d = root / sid
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o700)
    return str(d)


def clean_incoming(node: Node, max_age: float = INCOMING_MAX_AGE) -> list[str]:
    """Incoming dirs of moves that never finished (older than ``max_age``)."""
    root = node.root / INCOMING
    out = []
    if root.is_dir():
        for d in root.iterdir():
            try:
                if time.time() - d.stat().st_mtime > max_age:
                    shutil.rmtree(d, ignore_errors=True)
                    out.append(d.name)
            except OSError:
                continue
    return out


def import_parked(node: Node, doc: dict[str, Any]) -> SandboxRecord:
    """The moved files become this node's parked sandbox, same id (step 4)."""
    r = doc.get("record")
    h = doc.get("handle")
    if not isinstance(r, dict) or not isinstance(h, dict):
        raise UsageError("park_import needs the exported record and handle")
    sid = _check_sid(r.get("id"))
    backend = r.get("backend")
    if backend not in VM_BACKENDS:
        raise UsageError(f"cannot import a {backend!r} sandbox")
    name = doc.get("root_name")
    if not isinstance(name, str) or not _IMAGE_NAME.fullmatch(name):
        raise UsageError(f"invalid root image name {name!r}")
    spec = r.get("spec")
    if not isinstance(spec, dict) or not isinstance(r.get("image"), str) or \
            not isinstance(r.get("image_digest"), str):
        raise UsageError("park_import: malformed record")
    inc = node.root / INCOMING / sid
    for f in (*FILES, name):
        p = inc / f
        if p.is_symlink() or not p.is_file():
            raise UsageError(f"the moved sandbox lacks {f} (expected in {inc})")
    if node.db.get(sid) is not None or (node.sandboxes_dir / sid).exists():
        raise UsageError(f"this node already has a sandbox {sid}")
    created = r.get("created")
    expires = r.get("expires")
    rec = SandboxRecord(
        id=sid, backend=backend, image=r["image"], image_digest=r["image_digest"],
        status="creating", handle=None,
        created=float(created) if isinstance(created, int | float) else time.time(),
        expires=float(expires) if isinstance(expires, int | float) else None, spec=spec,
        owner_pid=os.getpid(), owner_start=_rootfs.proc_start_time(os.getpid()), layers=[])
    from_store = bool(spec.get("from_store"))
    node.db.insert(rec, [rec.image_digest] if from_store else [])
    sdir = node.sandboxes_dir / sid
    try:
        sdir.mkdir(mode=0o700)
        for f in FILES:  # renamed in before the dir is sealed (a mount: no rename across)
            os.rename(inc / f, sdir / f)
        os.rename(inc / name, sdir / ROOT_COPY)
        if os.geteuid() == 0:
            _rootfs.seal_dir(sdir)
        b: Any = node.backend(backend)
        state = b.moved_state(h, sid, sdir, sdir / ROOT_COPY, f"{node.cgroup_parent}/{sid}")
        if from_store:
            pins.pin(node.store(), node.cgroup_parent, node.root, sid, rec.image_digest)
        node.db.update(sid, status="parked", handle=state)
    except BaseException:
        node.teardown(SandboxHandle(sid, backend, {}), sdir)
        if from_store:
            pins.unpin(node.store, node.cgroup_parent, sid)
        node.db.delete(sid)
        raise
    finally:
        shutil.rmtree(inc, ignore_errors=True)
    rec.status, rec.handle = "parked", state
    return rec


# -- the client side -----------------------------------------------------------------------------
def _tar_argv(endpoint: Any, remote: list[str]) -> list[str]:
    """Run ``remote`` on a cluster node over its SSH master, or here for the local node."""
    entry = getattr(endpoint, "entry", None)
    if entry is None:
        return remote
    entry.target.ensure_master(entry.name)
    return entry.target.command_argv(remote)


def copy_files(src: Any, dst: Any, exported: dict[str, Any], into: str) -> None:
    """Stream the sandbox's files from ``src`` into ``into`` on ``dst`` (step 3)."""
    send = _tar_argv(src, ["tar", "-cSf", "-", "-C", exported["dir"], *FILES,
                           "-C", exported["root_dir"], exported["root_name"]])
    recv = _tar_argv(dst, ["tar", "-xSf", "-", "-C", into])
    with subprocess.Popen(send, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as a:
        b = subprocess.run(recv, stdin=a.stdout, capture_output=True)
        assert a.stdout is not None
        a.stdout.close()
        a_err = a.stderr.read() if a.stderr else b""
        a.wait()
    if a.returncode != 0 or b.returncode != 0:
        err = (a_err or b.stderr).decode(errors="replace").strip()[-1000:]
        raise SandboxError(f"copying the parked sandbox's files failed: {err}")


def move(src: Any, dst: Any, sid: str) -> dict[str, Any]:
    """Move a parked VM from node ``src`` to node ``dst`` and thaw it there (steps 1–5);
    the thaw's figures, with the sandbox's id on ``dst``."""
    exported = src.park_export(sid)
    local = exported["record"]["id"]
    into = dst.park_incoming(local)
    copy_files(src, dst, exported, into)
    moved = dst.park_import(exported)
    src.remove(sid)
    out = dict(dst.thaw(moved.id))
    out["moved_from"] = getattr(src, "name", "local")
    return out
