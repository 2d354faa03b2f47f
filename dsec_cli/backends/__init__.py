"""Sandbox backends behind one interface, selected by name through a lazy registry.

Backends depend only on `dsec_cli.core`: they are handed a rootfs (lower layer
directories plus a writable upper directory) and never see stores or specs.
"""

from __future__ import annotations

import importlib

from ..core.errors import UsageError
from .base import (
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
)

__all__ = [
    "Backend", "BackendContext", "ExecRequest", "ExecResult", "Limits", "OutputCallback",
    "RootfsSpec",
    "SandboxHandle", "SandboxSpec", "TreeSink", "UserIds", "backend_class", "get_backend",
    "BACKENDS",
]

#: backend name -> (module, class); registering one here is all the node and the
#: conformance suite (tests/conformance/backends.py) need to know of it
BACKENDS: dict[str, tuple[str, str]] = {
    "fncall": ("dsec_cli.backends.fncall", "FncallBackend"),
    "container": ("dsec_cli.backends.container", "ContainerBackend"),
    "microvm": ("dsec_cli.backends.vm.qemu", "MicroVMBackend"),
    "vm": ("dsec_cli.backends.vm.qemu", "VMBackend"),
}


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called ``name``, its module imported on first use: what
    the node asks of a backend's capabilities (`Backend.park_mechanism`, `fork_mode`...)
    without making one, and without loading the VM code unless a VM backend is asked."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise UsageError(f"the {name} backend is not available: {e}") from e
    kind: type[Backend] = getattr(mod, cls)
    return kind


def get_backend(name: str, ctx: BackendContext | None = None, **options: object) -> Backend:
    """The backend called ``name``: made from a node's context, or from explicit options."""
    kind = backend_class(name)
    backend: Backend = kind.from_context(ctx) if ctx is not None else kind(**options)  # type: ignore[call-arg]
    return backend
