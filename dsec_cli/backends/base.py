"""The backend contract: lifecycle (create, pause, resume, snapshot diff, destroy) apart from
work inside a sandbox (exec, put and get files), with typed requests and results.

A backend is stateless between calls: everything it needs to find a sandbox again (pids,
cgroup paths, sockets) is in the JSON-serializable `SandboxHandle.state`, which the node
database keeps, so a restarted dsec process can exec into, reconcile or destroy a sandbox.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal, Protocol

from ..core.errors import DsecError, UsageError

log = logging.getLogger(__name__)

#: called with ("stdout" | "stderr", bytes) as output arrives
OutputCallback = Callable[[str, bytes], None]
ParkMechanism = Literal["freezer", "state-file"]
ForkMode = Literal["snapshot", "tmp"]


@dataclass(frozen=True)
class Limits:
    cpus: float | None = None  # CPU share, e.g. 0.5 or 2
    memory: int | None = None  # bytes
    pids: int | None = None
    disk: int | None = None  # bytes of writable space
    cpu_class: str | None = None  # latency | batch | idle (_cgroups.CPU_CLASSES); None: untouched


@dataclass(frozen=True)
class RootfsSpec:
    lower_dirs: tuple[Path, ...]  # read-only layer trees, bottom to top
    upper_dir: Path  # writable diff, in overlayfs upper format
    work_dir: Path  # overlayfs work dir on the same filesystem as upper_dir


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    rootfs: RootfsSpec
    state_dir: Path  # private per-sandbox directory the backend may use
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    limits: Limits = Limits()
    network: Literal["none", "host", "allowlist"] = "none"
    #: with network "allowlist": what may leave (backends/egress.py), changeable while running
    egress: tuple[str, ...] = ()
    hostname: str = "sandbox"
    #: image digest, so backends may share per-image artifacts (e.g. a VM root disk)
    image_digest: str = ""
    #: the user the sandbox's commands run as by default (the image's, or --user)
    user: UserIds | None = None


@dataclass
class SandboxHandle:
    sandbox_id: str
    backend: str
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UserIds:
    """Who a command runs as: uid, primary gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> UserIds:
        return cls(int(doc["uid"]), int(doc["gid"]), tuple(int(g) for g in doc["groups"]))


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdin: bytes | None = None
    timeout: float | None = None
    #: bytes of each of stdout and stderr kept in the result (None: all); output past it
    #: still reaches the output callback
    capture_limit: int | None = None
    #: run as this user (None: as the sandbox's agent runs, root)
    user: UserIds | None = None


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float
    timed_out: bool = False
    oom_killed: bool = False  # the sandbox's memory limit killed a process during the exec
    pids_limited: bool = False  # a fork failed on the pids limit (where the kernel counts it)
    stdout_truncated: bool = False  # stdout went past the request's capture_limit
    stderr_truncated: bool = False


class TreeSink(Protocol):
    """Receives a file, symlink or directory copied out of a sandbox, entry by entry, parents
    before children. Everything it is given comes from the sandbox: hostile input."""

    def entry(self, kind: str, mode: int, size: int, rel: bytes, target: bytes) -> None:
        """kind 'f' (regular file of `size` bytes), 'd' or 'l' (symlink to `target`); `rel`
        is the path below the copied root, b"" for the root itself."""

    def chunk(self, offset: int, data: memoryview) -> None:
        """Content of the last regular file at `offset`; gaps between chunks are holes."""


@dataclass(frozen=True)
class BackendContext:
    """What a node hands every backend it makes: one object, so the node does not need to
    know each backend's constructor. Backends take the fields they use."""

    state_dir: Path  # the node's state dir: node-wide files (skeleton layer, VM root images)
    cgroup_parent: str = "dsec"  # the node's cgroup; each sandbox is a child of it
    runtime_root: Path | None = None  # the OCI runtime's (runc's) state
    kernel: str | None = None  # the guest kernel of the VM backends (None: the default)


class Backend(abc.ABC):
    name: ClassVar[str] = ""
    #: what a backend offers beyond the required lifecycle; without it the method raises a
    #: UsageError naming the backend (tests/conformance/backends.py checks both ways)
    supports_pause: ClassVar[bool] = False
    supports_snapshot: ClassVar[bool] = False

    # -- capabilities the node plans with (run/), read from the class: never by name -------
    #: a guest with a kernel of its own (QEMU): what the node reports of its memory (KSM)
    is_vm: ClassVar[bool] = False
    #: how `dsec park` keeps a stopped sandbox's memory out of RAM: "freezer" (the cgroup
    #: freezer, then reclaim to swap: needs `supports_pause`) or "state-file" (saved to a
    #: file by `park`, its process ended, back by `thaw`; such a sandbox can move nodes)
    park_mechanism: ClassVar[ParkMechanism] = "freezer"
    #: how `dsec fork` copies a sandbox's files: "snapshot" (its diff becomes a layer the
    #: copies share: needs `supports_snapshot`) or "tmp" (its /tmp, read through its agent,
    #: is written into new sandboxes of the same image)
    fork_mode: ClassVar[ForkMode] = "snapshot"
    #: the sandbox writes into an overlay upper dir on the host (``<sandbox dir>/upper``),
    #: which the node reads to digest a job's writable state (run/statedigest.py)
    upper_on_host: ClassVar[bool] = False
    #: a pool member's memory when it has no memory limit: about what an idle one holds
    member_estimate: ClassVar[int] = 16 << 20

    @classmethod
    def from_context(cls, ctx: BackendContext) -> Backend:
        """The backend as a node makes it; backends that take settings override this."""
        return cls()

    # -- lifecycle -------------------------------------------------------------------------
    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Start a sandbox and return once it accepts exec."""

    @abc.abstractmethod
    def destroy(self, handle: SandboxHandle) -> None:
        """Stop everything the sandbox owns (processes, mounts, cgroups, devices).
        Must succeed on a half-created or already-dead sandbox."""

    def pause(self, handle: SandboxHandle) -> None:
        raise UsageError(f"{self.name} sandboxes cannot be paused")

    def resume(self, handle: SandboxHandle) -> None:
        raise UsageError(f"{self.name} sandboxes cannot be paused or resumed")

    def park(self, handle: SandboxHandle) -> dict[str, Any]:
        """With park mechanism "state-file": save the running sandbox to a file and end its
        process; the figures ``resident_before``, ``state_bytes`` and ``save_seconds``."""
        raise UsageError(f"{self.name} sandboxes are not parked to a state file")

    def thaw(self, handle: SandboxHandle, commit: Callable[[dict[str, Any]], None],
             cpu_class: str | None = None) -> dict[str, Any]:
        """A sandbox `park` saved, running again; its new handle state (``commit`` is
        called with it as soon as it is known, before the sandbox runs)."""
        raise UsageError(f"{self.name} sandboxes are not parked to a state file")

    def snapshot_diff(self, handle: SandboxHandle) -> Path:
        """A directory in overlayfs upper format (whiteouts as 0:0 character devices,
        opaque directories marked by xattr) holding everything the sandbox changed."""
        raise UsageError(f"{self.name} sandboxes cannot be snapshotted")

    def set_egress(self, handle: SandboxHandle, rules: list[str]) -> None:
        """Replace a running sandbox's egress allowlist (network "allowlist" only): the
        host-side filter of its link (backends/egress.py), the same for every backend."""
        eg = handle.state.get("egress")
        if not eg:
            raise UsageError(f"sandbox {handle.sandbox_id} was not created with network "
                             "allowlist: its egress cannot change")
        from . import egress

        egress.set_rules(eg, rules)
        self.pin_names(handle)

    def pin_names(self, handle: SandboxHandle) -> None:
        """Write the allowlist's names, as the host resolved them, into the sandbox's
        /etc/hosts (through its agent, in its own view; earlier pins replaced). A sandbox
        whose /etc is read-only (fncall) keeps its file: its rules hold, names do not
        resolve inside."""
        eg = handle.state.get("egress") or {}
        if not eg.get("pins") and not eg.get("pinned"):
            return
        from . import egress

        try:
            try:
                old = self.get_file(handle, "/etc/hosts")
            except DsecError:
                old = b""
            self.put_file(handle, "/etc/hosts", egress.hosts_file(old, eg.get("pins", {})))
            eg["pinned"] = bool(eg.get("pins"))
        except DsecError as e:
            log.warning(
                "sandbox %s: egress names not pinned in /etc/hosts: %s", handle.sandbox_id, e)

    def drop_connections(self) -> None:
        """Close the connections to sandboxes this object keeps open for later calls (a
        long-lived process between commands: an agent may take one connection at a time).
        None by default."""
        return None

    def is_alive(self, handle: SandboxHandle) -> bool:
        return True

    def cgroup(self, handle: SandboxHandle) -> str | None:
        """The cgroup (relative path) holding everything the sandbox runs, where it has one:
        what CPU classes, memory reclamation and `dsec top` act on."""
        cg = handle.state.get("cgroup")
        return str(cg) if cg else None

    def describe(self, handle: SandboxHandle) -> dict[str, Any]:
        """Backend facts for `dsec ps` / `inspect` (acceleration, pids...)."""
        return {}

    # -- work inside -----------------------------------------------------------------------
    @abc.abstractmethod
    def exec(self, handle: SandboxHandle, request: ExecRequest,
             on_output: OutputCallback | None = None) -> ExecResult: ...

    @abc.abstractmethod
    def put_file(self, handle: SandboxHandle, path: str, data: bytes,
                 mode: int = 0o644, user: UserIds | None = None) -> None:
        """Create or truncate a file (and its missing parents) and write `data`, with
        `user`'s ids (None: as the sandbox's agent, root): permissions apply to them, and
        what is created is theirs."""

    @abc.abstractmethod
    def get_file(self, handle: SandboxHandle, path: str, user: UserIds | None = None
                 ) -> bytes:
        """A regular file's content, read with `user`'s ids (None: as the agent)."""

    def put_stream(self, handle: SandboxHandle, path: str, src: BinaryIO,
                   mode: int = 0o644) -> int:
        """Write a host file into the sandbox without holding it in memory; its size."""
        data = src.read()
        self.put_file(handle, path, data, mode)
        return len(data)

    def get_tree(self, handle: SandboxHandle, path: str, sink: TreeSink) -> None:
        """Copy a file, symlink or directory out of the sandbox into `sink`, streamed."""
        raise NotImplementedError(f"{self.name} cannot copy files out")
