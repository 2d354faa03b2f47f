"""What a sandbox is created with (`CreateOptions`) and its validation: every option is
checked before anything is reserved or made, with an error naming the flag.

`CreateOptions` is the one list of sandbox options. What else names them derives from it
(the node protocol sends the dataclass, a job's row stores it) or is checked against it
(`tests/api/test_options.py`): the keywords of `Sandbox(...)`, `AsyncSandbox.create` and
`create_options`, and the flags of `dsec run`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..backends import BACKENDS, _cgroups, _rootfs
from ..core.errors import UsageError
from ..core.units import MAX_SIZE

#: the backends a sandbox may ask for: the registry's (backends.BACKENDS)
BACKEND_CHOICES = tuple(sorted(BACKENDS))
CPU_CLASS_CHOICES = tuple(_cgroups.CPU_CLASSES)  # latency | batch | idle (docs/density.md)
MIN_MEMORY = 8 << 20
MIN_DISK = _rootfs.MIN_DISK
#: the options that are a sandbox's resource limits (`backends.Limits`, ``spec["limits"]``)
LIMIT_FIELDS = ("cpus", "memory", "pids", "disk", "cpu_class")
#: options the SDK's sandbox constructors leave to the node (``dsec run --fetch``, config)
NODE_CHOSEN = ("fetch", "record_seconds")
#: `dsec run` flags not spelled ``--NAME`` (underscores as dashes)
FLAGS = {"cpu_class": "--class"}


@dataclass
class CreateOptions:
    backend: str = "container"
    cpus: float | None = None
    memory: int | None = None
    pids: int | None = None
    ttl: float | None = None
    network: Literal["none", "host", "allowlist"] = "none"
    egress: list[str] = field(default_factory=list)  # network "allowlist": host:PORT, IP:PORT
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    disk: int | None = None  # bytes the sandbox may write (its upper dir, or /tmp for fncall)
    fetch: str = "auto"  # auto | eager | lazy | background (docs/lazy.md)
    record_seconds: float | None = None  # lazy: profile reads this long (default 30 s)
    cpu_class: str | None = None  # latency | batch | idle; None: batch, nothing written
    user: str | None = None  # who commands run as (NAME, UID, NAME:GROUP...): else the image's

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option, in the order of the dataclass."""
        return tuple(f.name for f in fields(cls))

    def limits(self) -> dict[str, Any]:
        """The resource limits, as `backends.Limits` takes them and the state row keeps them."""
        return {k: getattr(self, k) for k in LIMIT_FIELDS}

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
        if self.network not in ("none", "host", "allowlist"):
            raise UsageError(f"invalid --network {self.network!r}: choose none, host or "
                             "allowlist")
        if self.egress and self.network != "allowlist":
            raise UsageError("egress rules need network allowlist")
        if self.network == "allowlist":
            from ..backends.egress import parse_rule

            for rule in self.egress:
                parse_rule(rule)
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise UsageError(f"invalid workdir {self.workdir!r}: must be an absolute path")
        if self.cpu_class is not None and self.cpu_class not in CPU_CLASS_CHOICES:
            raise UsageError(f"invalid --class {self.cpu_class!r}: choose one of "
                             f"{', '.join(CPU_CLASS_CHOICES)}")
        if self.user is not None and (not self.user or len(self.user) > 256
                                      or any(c in self.user for c in "\0\n/")):
            raise UsageError(f"invalid --user {self.user!r}: expected NAME, UID, NAME:GROUP "
                             "or UID:GID")
        if self.fetch not in ("auto", "eager", "lazy", "background"):
            raise UsageError(f"invalid --fetch {self.fetch!r}: choose auto, eager, lazy or "
                             "background")

