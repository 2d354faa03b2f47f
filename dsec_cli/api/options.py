"""Sandbox options as the SDK and the CLI take them, checked into `CreateOptions`: sizes
("512M") and durations ("10m") as strings or numbers, each error naming its option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core import validate
from ..core.errors import UsageError
from ..run.options import CreateOptions

__all__ = ["create_options", "new_sandbox_options", "secs", "size"]


def size(v: int | str | None, what: str) -> int | None:
    """Bytes: an int as given, a string such as "512M" parsed."""
    return None if v is None else v if isinstance(v, int) else validate.size(v, what)


def secs(v: float | str | None, what: str) -> float | None:
    """Seconds: a number as given, a string such as "10m" parsed."""
    return None if v is None else float(v) if isinstance(v, int | float) \
        else validate.duration(v, what)


def create_options(backend: str = "container", *, cpus: float | None = None,
                   memory: int | str | None = None, pids: int | None = None,
                   ttl: float | str | None = None, network: str = "none",
                   env: dict[str, str] | None = None, workdir: str | None = None,
                   fetch: str = "auto", disk: int | str | None = None,
                   cpu_class: str | None = None, prefix: str = "",
                   user: str | None = None, egress: list[str] | None = None) -> CreateOptions:
    """Checked create options; errors name each option with ``prefix`` (``--`` for flags).
    ``egress``: what network ``allowlist`` lets out (``host:PORT``, ``IPV4:PORT``)."""
    validate.positive_float(cpus, prefix + "cpus", validate.MAX_CPUS)
    validate.positive_int(pids, prefix + "pids", maximum=validate.MAX_PIDS)
    rules = list(egress or [])
    if rules:
        from ..backends.egress import parse_rule

        for rule in rules:
            parse_rule(rule)  # each bad rule is named
        if network != "allowlist":
            raise UsageError(f"{prefix}egress {rules[0]!r} needs {prefix}network allowlist")
    return CreateOptions(backend=backend, cpus=cpus, memory=size(memory, prefix + "memory"),
                         pids=pids, ttl=secs(ttl, prefix + "ttl"),
                         network=network, env=dict(env or {}),  # type: ignore[arg-type]
                         workdir=workdir, fetch=fetch, disk=size(disk, prefix + "disk"),
                         cpu_class=cpu_class, user=user, egress=rules)


def new_sandbox_options(image: str | Path, node: str | None, backend: str, *,
                        egress: list[str] | None = None, **options: Any) -> CreateOptions:
    """The checked image, node and options of a new `Sandbox` or `AsyncSandbox` (the
    keywords of `create_options`), before anything is made."""
    if isinstance(image, str):
        validate.image(image, "image")
    validate.node_option(node, "node")
    opts = create_options(backend, **options)
    opts.egress = list(egress or [])  # checked against the network by `CreateOptions`
    return opts
