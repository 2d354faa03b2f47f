"""Thaw on another node (`dsec thaw ID --to NODE`): a VM parked to a state file
(backends/vm/vmpark.py) moves with its files and thaws there, keeping its id.

What moves: the state file, the writable disk, and the read-only root image the guest has
been reading (it becomes the sandbox's own copy on the target: a root image built there from
the same layers need not be byte-identical, and the guest's page cache holds blocks of this
one). The target's own kernel, initramfs and QEMU stand in for the source's (the guest
booted long ago: only their devices must match, which the same dsec install gives).

A node is not trusted by another: what the source sends is data, never an argv, a path or an
option on the target. The target builds the guest's QEMU command line from its own config,
the moved record (backend, CPUs, memory, pids, disk; checked as a create's options are) and
its own state dir (`QemuBackend.parked_argv`), keeps only checked plain fields of the moved
handle (vmpark.moved_state), and writes the files only through `receive`: the expected names,
each once, regular files (sparse kept), within bounds, into its own incoming dir.

The steps, each on the node that owns the data:

1. ``park_export`` on the source: the sandbox must be a parked VM with a complete state file
   and no job's journal on that node; where its files are.
2. ``park_incoming`` on the target: an empty ``<state>/incoming/<id>/`` (refused when the
   target already has a sandbox with that id).
3. the client streams the files between them: ``tar -c`` on the source, `receive` on the
   target (``dsec node receive-moved ID`` over its SSH master; in this process for the local
   node).
4. ``park_import`` on the target: the record checked, a ``creating`` row first (as any
   create), the files moved into the sandbox's state dir, its handle state built here, the
   row ``parked``.
5. the source's sandbox removed (never two copies that can run), then ``thaw`` on the target.

A failure before 5 leaves the source as it was (parked) and the target's incoming dir, which
node gc removes after a day. Container and fncall sandboxes do not move: that would need a
checkpoint of their processes (CRIU), which this host cannot take (`dsec node check --host`).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..backends import SandboxHandle, _rootfs, backend_class
from ..backends.base import Limits
from ..backends.vm import vmpark
from ..backends.vm.vmimage import DEFAULT_DISK_SIZE
from ..backends.vm.vmpark import check_moved_env
from ..core import validate
from ..core.digests import check_digest
from ..core.errors import SandboxError, UsageError
from ..core.rundir import check_private, open_beneath, private_dir
from . import pins
from .options import CreateOptions
from .state import SandboxRecord

if TYPE_CHECKING:
    from .node import Node

STATE, DISK = "park.state", "disk.ext4"
FILES = (STATE, DISK)
ROOT_COPY = "root.erofs"
INCOMING = "incoming"
INCOMING_MAX_AGE = 86400.0
_SID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_IMAGE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\.erofs")
#: what a moved record's spec may hold (run/node.py writes these)
_SPEC_KEYS = frozenset({"limits", "network", "env", "workdir", "layer_digests", "from_store",
                        "fetch", "entrypoint", "cmd", "pool"})
_LIMIT_KEYS = frozenset({"cpus", "memory", "pids", "disk", "cpu_class"})
_RECORD_KEYS = frozenset({"id", "backend", "image", "image_digest", "spec", "created",
                          "expires"})
#: a state file holds the guest's RAM and device state: never more than this node's memory
#: and swap could hold as one guest's RAM, plus room for the devices
STATE_SLACK = 256 << 20
#: free space a receive leaves on the target's filesystem
FREE_RESERVE = 1 << 30
_COPY = 1 << 20


def _job_of(node: Node, sid: str) -> str | None:
    if not (node.root / "jobs.db").exists():
        return None
    from .jobs import node_jobs

    rows = node_jobs(node).db.q("SELECT job FROM rollouts WHERE sandbox=?", (sid,))
    return str(rows[0]["job"]) if rows else None


def export_parked(node: Node, sid: str) -> dict[str, Any]:
    """Where a parked VM's files are, and what its row holds (step 1)."""
    rec = node.lookup(sid)
    if backend_class(rec.backend).park_mechanism != "state-file":
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
    root = private_dir(node.root / INCOMING)
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


def _number(v: Any, what: str, kind: type = int) -> Any:
    if v is None:
        return None
    ok = isinstance(v, int | float) if kind is float else isinstance(v, int)
    if not ok or isinstance(v, bool) or not math.isfinite(v):
        raise UsageError(f"the moved record's {what} {validate.shown(v)} is not a number")
    return v


def _moved_options(r: dict[str, Any]) -> CreateOptions:
    """A moved record's backend, limits, network, env and workdir as a create's options,
    checked as a create's are (known keys only, types, ranges)."""
    spec = r.get("spec")
    if not isinstance(spec, dict) or not set(spec) <= _SPEC_KEYS:
        extra = sorted(set(spec) - _SPEC_KEYS) if isinstance(spec, dict) else []
        raise UsageError(f"the moved record's spec is malformed (unknown keys: "
                         f"{validate.shown(extra)})")
    lim = spec.get("limits") or {}
    if not isinstance(lim, dict) or not set(lim) <= _LIMIT_KEYS:
        raise UsageError(f"the moved record's limits {validate.shown(lim)} are malformed")
    cls = lim.get("cpu_class")
    env = check_moved_env(spec.get("env") or {}, "the moved record")
    network, workdir = spec.get("network", "none"), spec.get("workdir")
    if network == "allowlist" or not isinstance(network, str):
        raise UsageError(f"the moved record's network {validate.shown(network)} cannot move")
    if workdir is not None and not isinstance(workdir, str):
        raise UsageError(f"the moved record's workdir {validate.shown(workdir)} is malformed")
    opts = CreateOptions(backend=str(r.get("backend")), cpus=_number(lim.get("cpus"), "cpus",
                                                                      float),
                         memory=_number(lim.get("memory"), "memory"),
                         pids=_number(lim.get("pids"), "pids"),
                         disk=_number(lim.get("disk"), "disk"),
                         cpu_class=cls if cls is None else str(cls),
                         network=network,  # type: ignore[arg-type]
                         env=dict(env), workdir=workdir)
    opts.validate()
    if backend_class(opts.backend).park_mechanism != "state-file":
        raise UsageError(f"cannot import a {opts.backend!r} sandbox")
    return opts


def _moved_spec(r: dict[str, Any], opts: CreateOptions) -> dict[str, Any]:
    """The spec row of a moved record: its checked fields, nothing else."""
    spec = r["spec"]
    digests = spec.get("layer_digests") or []
    if not isinstance(digests, list) or len(digests) > 4096:
        raise UsageError("the moved record's layer_digests must be a list of digests")
    for d in digests:
        check_digest(d if isinstance(d, str) else "")
    from_store = spec.get("from_store", False)
    fetch = spec.get("fetch", "eager")
    if not isinstance(from_store, bool) or fetch not in ("auto", "eager", "lazy", "background"):
        raise UsageError("the moved record's from_store or fetch is malformed")
    out: dict[str, Any] = {
        "limits": {"cpus": opts.cpus, "memory": opts.memory, "pids": opts.pids,
                   "disk": opts.disk, "cpu_class": opts.cpu_class},
        "network": opts.network, "env": opts.env, "workdir": opts.workdir,
        "layer_digests": list(digests), "from_store": from_store, "fetch": fetch}
    for key in ("entrypoint", "cmd"):
        value = spec.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > 4096 or \
                not all(isinstance(a, str) and len(a) <= 65536 for a in value):
            raise UsageError(f"the moved record's {key} must be a list of strings")
        out[key] = list(value)
    return out


def _moved_time(v: Any, what: str) -> float | None:
    if v is None:
        return None
    return float(_number(v, what, float))


def import_parked(node: Node, doc: dict[str, Any]) -> SandboxRecord:
    """The moved files become this node's parked sandbox, same id (step 4). The exported
    document is the source node's: only its checked fields are kept, and the handle state
    is built here."""
    r = doc.get("record")
    h = doc.get("handle")
    if not isinstance(r, dict) or not isinstance(h, dict):
        raise UsageError("park_import needs the exported record and handle")
    if not set(r) <= _RECORD_KEYS:
        raise UsageError(f"the moved record has unknown keys: "
                         f"{validate.shown(sorted(set(r) - _RECORD_KEYS))}")
    sid = _check_sid(r.get("id"))
    opts = _moved_options(r)
    backend = opts.backend
    spec = _moved_spec(r, opts)
    name = doc.get("root_name")
    if not isinstance(name, str) or not _IMAGE_NAME.fullmatch(name):
        raise UsageError(f"invalid root image name {validate.shown(name)}")
    image = validate.image(r.get("image"), "moved image")
    digest = r.get("image_digest")
    digest = check_digest(digest) if spec["from_store"] and isinstance(digest, str) else \
        validate.text(digest, "moved image digest", max_len=4096)
    inc = node.root / INCOMING / sid
    check_private(inc)
    for f in (*FILES, ROOT_COPY):
        _check_received(inc, f)
    disk_size = os.lstat(inc / DISK).st_size

    if disk_size != (opts.disk or DEFAULT_DISK_SIZE):
        raise UsageError(f"the moved disk is {disk_size} bytes, not the "
                         f"{opts.disk or DEFAULT_DISK_SIZE} its record's disk limit makes")
    if node.db.get(sid) is not None or (node.sandboxes_dir / sid).exists():
        raise UsageError(f"this node already has a sandbox {sid}")
    created = _moved_time(r.get("created"), "created")
    rec = SandboxRecord(
        id=sid, backend=backend, image=image, image_digest=digest,
        status="creating", handle=None, created=created or time.time(),
        expires=_moved_time(r.get("expires"), "expires"), spec=spec,
        owner_pid=os.getpid(), owner_start=_rootfs.proc_start_time(os.getpid()), layers=[])
    from_store = spec["from_store"]
    node.db.insert(rec, [rec.image_digest] if from_store else [])
    sdir = node.sandboxes_dir / sid
    try:
        sdir.mkdir(mode=0o700)
        for f in (*FILES, ROOT_COPY):  # renamed in before the dir is sealed (a mount)
            os.rename(inc / f, sdir / f)
        if os.geteuid() == 0:
            _rootfs.seal_dir(sdir)
        b: Any = node.backend(backend)
        limits = Limits(cpus=opts.cpus, memory=opts.memory, pids=opts.pids, disk=opts.disk,
                        cpu_class=opts.cpu_class)
        state = b.moved_state(h, sid, sdir, sdir / ROOT_COPY, f"{node.cgroup_parent}/{sid}",
                              limits)
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


def _check_received(inc: Path, name: str) -> None:
    try:
        st = os.lstat(inc / name)
    except FileNotFoundError:
        raise UsageError(f"the moved sandbox lacks {name} (expected in {inc})") from None
    if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
        raise UsageError(f"the moved {name} in {inc} is not a plain regular file")


# -- the receiving end ---------------------------------------------------------------------------
def receive(node: Node, sid: str, stream: IO[bytes]) -> list[str]:
    """Write the moved files of sandbox ``sid``, read as a tar stream from ``stream``, into
    this node's incoming dir for it (made by `incoming`; step 3's receiving end). Only
    ``park.state``, ``disk.ext4`` and one ``*.erofs`` root image (written as
    ``root.erofs``) are taken, each once, each a regular file, opened beneath the dir with
    ``O_NOFOLLOW|O_EXCL``; holes of sparse members stay holes. Anything else (another name,
    an absolute or ``..`` path, a link, a device, a FIFO, a directory, a state file larger
    than this node's memory and swap, more bytes than the filesystem has free) is refused,
    and the dir is emptied. The names written."""
    inc = node.root / INCOMING / _check_sid(sid)
    check_private(inc)
    if any(inc.iterdir()):
        raise UsageError(f"the incoming dir {inc} is not empty")
    budget = shutil.disk_usage(inc).free - FREE_RESERVE
    written: list[str] = []
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                name = _member_target(m, written)
                budget -= _write_member(tar, m, inc, name, budget)
                written.append(name)
    except tarfile.TarError as e:
        _empty(inc)
        raise UsageError(f"the moved files of sandbox {sid} are not a valid tar stream: "
                         f"{e}") from e
    except BaseException:
        _empty(inc)
        raise
    missing = [f for f in (*FILES, ROOT_COPY) if f not in written]
    if missing:
        _empty(inc)
        raise UsageError(f"the moved files of sandbox {sid} lack {', '.join(missing)}")
    return written


def _member_target(m: tarfile.TarInfo, written: list[str]) -> str:
    """The name a member is written under, or a refusal naming it."""
    shown = validate.shown(m.name, 300)
    if m.name in FILES:
        name = m.name
    elif _IMAGE_NAME.fullmatch(m.name):
        name = ROOT_COPY
    else:
        raise UsageError(f"the moved files hold {shown}: only {', '.join(FILES)} and one "
                         "root image (NAME.erofs) may move")
    if not m.isreg():
        kind = "a link" if m.issym() or m.islnk() else "a FIFO" if m.isfifo() else \
            "a device" if m.isdev() else "a directory" if m.isdir() else "not a regular file"
        raise UsageError(f"the moved member {shown} is {kind}: only regular files may move")
    if name in written:
        raise UsageError(f"the moved files hold {shown} twice (or two root images)")
    if name == STATE and m.size > _memory_bound():
        raise UsageError(f"the moved state file is {m.size} bytes, more than this node's "
                         "memory and swap could hold for a guest")
    return name


def _memory_bound() -> int:
    total = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(("MemTotal:", "SwapTotal:")):
                total += int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return total + STATE_SLACK


def _write_member(tar: tarfile.TarFile, m: tarfile.TarInfo, inc: Path, name: str,
                  budget: int) -> int:
    """Copy one member's data into ``inc/name``, read straight from the stream (a sparse
    member stores only its data regions, in order: each is written at its offset, the holes
    stay holes); the bytes it stored. More than ``budget`` is refused."""
    # a GNU map pads with empty entries and ends with (size, 0)
    sparse: list[tuple[int, int]] | None = m.sparse  # type: ignore[assignment]
    regions = [(o, n) for o, n in sparse if n] if sparse is not None else [(0, m.size)]
    stored, end = 0, 0
    for offset, n in regions:
        if offset < end or n < 0 or offset + n > m.size:
            raise UsageError(f"the moved {name} has a sparse map out of order or past its "
                             "size")
        stored, end = stored + n, offset + n
    if stored > budget:
        raise UsageError(f"the moved {name} needs {stored} bytes; the filesystem of this "
                         "node's state has room for fewer")
    fd = open_beneath(inc, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        for offset, n in regions:
            while n:
                chunk = tar.fileobj.read(min(n, _COPY))  # type: ignore[union-attr]
                if not chunk:
                    raise UsageError(f"the moved {name} ends before its declared size")
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
                n -= len(chunk)
        os.ftruncate(fd, m.size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return stored


def _empty(inc: Path) -> None:
    for p in inc.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# -- the client side -----------------------------------------------------------------------------
def _tar_argv(endpoint: Any, remote: list[str]) -> list[str]:
    """Run ``remote`` on a cluster node over its SSH master, or here for the local node."""
    entry = getattr(endpoint, "entry", None)
    if entry is None:
        return remote
    entry.target.ensure_master(entry.name)
    return entry.target.command_argv(remote)


def copy_files(src: Any, dst: Any, exported: dict[str, Any], sid: str) -> None:
    """Stream the sandbox's files from ``src`` into its incoming dir on ``dst`` (step 3):
    ``tar -c`` of the source's own files there, `receive` on the target."""
    root_name = exported.get("root_name")
    if not isinstance(root_name, str) or not _IMAGE_NAME.fullmatch(root_name):
        raise UsageError(f"invalid root image name {validate.shown(root_name)}")
    send = _tar_argv(src, ["tar", "-cSf", "-", "-C", str(exported["dir"]), *FILES,
                           "-C", str(exported["root_dir"]), root_name])
    entry = getattr(dst, "entry", None)
    with subprocess.Popen(send, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as a:
        assert a.stdout is not None
        try:
            if entry is None:
                receive(dst, sid, a.stdout)
                recv_err, recv_code = b"", 0
            else:
                entry.target.ensure_master(entry.name)
                b = subprocess.run(entry.target.command_argv(
                    [entry.dsec, "node", "receive-moved", sid]), stdin=a.stdout,
                    capture_output=True)
                recv_err, recv_code = b.stderr, b.returncode
        except BaseException:
            a.kill()
            raise
        finally:
            a.stdout.close()
        a_err = a.stderr.read() if a.stderr else b""
        a.wait()
    if recv_code == 2:  # the target refused what it was sent
        raise UsageError(f"the target node refused the moved files: "
                         f"{recv_err.decode(errors='replace').strip()[-1000:]}")
    if a.returncode != 0 or recv_code != 0:
        err = (a_err or recv_err).decode(errors="replace").strip()[-1000:]
        raise SandboxError(f"copying the parked sandbox's files failed: {err}")


def move(src: Any, dst: Any, sid: str) -> dict[str, Any]:
    """Move a parked VM from node ``src`` to node ``dst`` and thaw it there (steps 1–5);
    the thaw's figures, with the sandbox's id on ``dst``."""
    exported = src.park_export(sid)
    local = exported["record"]["id"]
    dst.park_incoming(local)
    copy_files(src, dst, exported, local)
    moved = dst.park_import(exported)
    src.remove(sid)
    out = dict(dst.thaw(moved.id))
    out["moved_from"] = getattr(src, "name", "local")
    return out
