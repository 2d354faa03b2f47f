"""Cluster errors, children of the one tree in dsec_cli.core.errors.

`NodeUnreachableError` (core) is the only node error that is retried: the connection failed
or timed out. A refused host key or key is never retried (retrying cannot fix it); a command
that ran and failed is an exit code or the node service's own error, never retried either."""

from __future__ import annotations

from ...core.errors import DsecError, SandboxError, UsageError


class HostKeyError(DsecError):
    """SSH refused the node: unknown or changed host key, or the user key was rejected."""


class NodeCommandError(DsecError):
    """The node answered, but not with the dsec node protocol (no dsec there, bad version)."""


class CapacityError(SandboxError):
    """The node's service refused a sandbox: it would exceed the node's capacity."""


class ProtocolError(UsageError):
    """A message from the other side does not fit the protocol: an unknown field, a field of
    the wrong type, a required field missing. The two sides run different dsec versions."""
