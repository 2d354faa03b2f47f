"""The one exception tree of dsec.

Every error a user can meet derives from `DsecError` and carries the exit code the CLI
uses: 2 for usage or bad input (nothing was changed), 1 for a runtime failure.
Dependency errors (boto3, oras, subprocess, OSError) are mapped at the stage boundary
and chained with ``raise ... from``.
"""

from __future__ import annotations


class DsecError(Exception):
    """Base of every expected dsec failure."""

    exit_code = 1
    #: where the failure is an OS error (a file read or written in a sandbox): its number
    #: (``errno.ENOENT``, ``EACCES``, ``EISDIR``...) and the file, as `OSError` has them
    errno: int | None = None
    filename: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class UsageError(DsecError):
    """Bad input: a wrong flag, a malformed spec, an unknown reference."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration file or DSEC_* variable is wrong; names the file and key."""


class SpecError(UsageError):
    """A layer or image spec is invalid; the message names file and line."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 hint: str | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message, hint=hint)
        self.path = path
        self.line = line


class NotFoundError(UsageError):
    """A reference, object or sandbox that does not exist."""


class RefConflictError(UsageError):
    """A ``name@version`` that a store already holds with other content: versions are
    immutable, so writing it again is refused unless the caller asks to replace it."""

    def __init__(self, ref: str, store: str, current: str, new: str, *, verb: str) -> None:
        made = f"; {verb} {new}" if new else f"; {verb}"
        super().__init__(
            f"{ref} in {store} already names {current}{made}",
            hint="versions are immutable: bump the version, or pass --replace to move "
                 f"{ref} to the new content")
        self.ref = ref
        self.current = current
        self.new = new


class BuildError(DsecError):
    """A build step failed at run time (a `run` command exited non-zero, I/O failed)."""


class FormatError(DsecError):
    """Stored data (a store object, an archive, a tree to write) is malformed or of an
    unsupported version. It is hostile input as far as dsec knows: exit 2, like other bad
    input."""

    exit_code = 2


class CorruptObjectError(FormatError):
    """A store object (ref, manifest, index, pack, chunk) is malformed, out of bounds or
    inconsistent with what refers to it. The message names the object (kind, short digest)
    and field."""


class IntegrityError(CorruptObjectError):
    """Stored data does not match its digest: corruption or tampering."""


class StoreError(DsecError):
    """A store operation failed (I/O, network, permissions)."""


class TransientStoreError(StoreError):
    """A store failure worth retrying: connection errors, throttling, 5xx."""


class StoreTimeoutError(TransientStoreError):
    """An endpoint accepted a connection (or not) and did not answer in time.

    ``waited`` is how long this one attempt waited; the retry policy uses it so that
    retries of a silent endpoint do not multiply the wait past one overall bound."""

    def __init__(self, message: str, *, waited: float, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.waited = waited


class StoreUnavailableError(StoreError):
    """The store cannot be reached at all."""


class BackendError(DsecError):
    """A sandbox backend failed to create, run or destroy a sandbox."""


class SandboxError(DsecError):
    """A sandbox operation failed (not the command inside it: that is an exit code)."""


class NodeUnreachableError(DsecError):
    """A cluster node did not answer; the only node error that is retried."""
