"""The node contract: the operations every node offers, whether this machine's `Node`
(run/node.py) or a cluster node reached over SSH (`RemoteNode`, run/cluster/remote.py).

The API (dsec_cli/api/) holds nodes by this type, so a sandbox id routes to either kind and
the caller cannot tell them apart. tests/run/test_contract.py checks with `inspect.signature`
that both classes offer every method here with compatible parameters, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..backends.base import ExecResult, OutputCallback

if TYPE_CHECKING:
    from .node import CreateOptions


class SandboxRef(Protocol):
    """What a node returns for a sandbox: a local `SandboxRecord` or a `RemoteRecord`."""

    id: str

    @property
    def status(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def image(self) -> str: ...

    def public(self) -> dict[str, Any]: ...


@runtime_checkable
class NodeAPI(Protocol):
    """One node's sandboxes: lifecycle, work inside them, and node facts."""

    # -- node facts ------------------------------------------------------------------------
    def info(self, image: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Version, hostname, store and cached bytes; with ``image``, how much of it the
        node's cache holds (``image``) or why the node cannot use it (``image_error``)."""
        ...

    def sandboxes(self) -> list[Any]:
        """Every sandbox on the node, as `SandboxRef`s."""
        ...

    def gc(self, budget: int | None = None, dry_run: bool = False) -> dict[str, Any]:
        """Remove expired or dead sandboxes and evict cached layers past ``budget``."""
        ...

    # -- lifecycle -------------------------------------------------------------------------
    def create(self, image: str, opts: CreateOptions | None = None) -> Any:
        ...

    def lookup(self, sid: str) -> Any:
        ...

    def describe(self, sid: str) -> dict[str, Any]:
        ...

    def fetch_stats(self, rec: Any) -> dict[str, Any] | None:
        """A lazily fetched sandbox's fetch figures (None for eagerly fetched ones)."""
        ...

    def pause(self, sid: str) -> Any:
        ...

    def resume(self, sid: str) -> Any:
        ...

    def snapshot(self, sid: str, ref: str, push: str | None = None, *,
                 replace: bool = False) -> dict[str, Any]:
        ...

    # -- density (run/density.py) ----------------------------------------------------------
    def park(self, sid: str) -> dict[str, Any]:
        """Stop a sandbox and push its memory out; resident, reclaimed and swapped bytes."""
        ...

    def thaw(self, sid: str, prefetch: bool = False) -> dict[str, Any]:
        """Let a parked sandbox run again, with the same files and processes; ``prefetch``
        also reads its memory back from swap now (a running one's too)."""
        ...

    # -- moving a parked VM to another node (run/migrate.py) --------------------------------
    def park_export(self, sid: str) -> dict[str, Any]:
        """Where a parked VM's files are, and its row: what another node imports."""
        ...

    def park_incoming(self, sid: str) -> str:
        """An empty directory on this node for a moving sandbox's files."""
        ...

    def park_import(self, exported: dict[str, Any]) -> Any:
        """The moved files become this node's parked sandbox, with the same id."""
        ...

    def top(self, interval: float = 0.0) -> list[dict[str, Any]]:
        """Per sandbox: CPU, resident, reclaimed and swapped memory, class, idle time."""
        ...

    def remove(self, sid: str) -> Any:
        ...

    def fork(self, sid: str, n: int) -> dict[str, Any]:
        """``n`` copies of a sandbox's files; ``copies`` holds their `SandboxRef`s."""
        ...

    # -- work inside a sandbox -------------------------------------------------------------
    def exec(self, sid: str, argv: list[str], *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | Iterable[bytes] | None = None,
             timeout: float | None = None, on_output: OutputCallback | None = None,
             capture_limit: int | None = None, user: str | None = None) -> ExecResult:
        """``user``: who the command runs as instead of the sandbox's user (where the node
        takes it: this machine's)."""
        ...

    def put_file(self, sid: str, path: str, data: bytes, mode: int = 0o644,
                 user: str | None = None) -> None:
        """As the sandbox's user; ``user`` overrides it as exec's does."""
        ...

    def get_file(self, sid: str, path: str, user: str | None = None) -> bytes:
        ...

    def get_file_with_mode(self, sid: str, path: str, user: str | None = None
                           ) -> tuple[bytes, int]:
        ...
