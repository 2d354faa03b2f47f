"""The compiled parts of dsec and whether each is live: the C extension modules, each with a
Python twin that does the same work when it is not built, and the static in-sandbox agent.

The package build (setup.py) compiles them all, each optionally; this module names them and,
asked, says for each whether this installation runs it or falls back, and why. Parts are
named by dotted module path and imported by name only when asked, as the store registry
names its classes, so this list sits below the stages that hold them."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from .settings import env


@dataclass(frozen=True)
class CompiledModule:
    """One C extension: its module, its source (relative to the package) and what runs
    without it; ``off`` names the DSEC_* setting that turns it off, if any."""

    module: str
    source: str
    fallback: str
    off: str = ""


#: every C extension in the package, each kept for a measured speed-up (docs/benchmarks.md)
MODULES: tuple[CompiledModule, ...] = (
    CompiledModule("dsec_cli.format._walk", "format/_walk.c",
                   "builds walk and read trees in Python", off="DSEC_PY_WALK"),
    CompiledModule("dsec_cli.format._cdc", "format/_cdc.c",
                   "builds cut with fastcdc's generator"),
    CompiledModule("dsec_cli.format._entryjson", "format/_entryjson.c",
                   "index entries are written as JSON in Python"),
    CompiledModule("dsec_cli.build._tarhdr", "build/_tarhdr.c",
                   "imports read tar headers with tarfile's parser"),
    CompiledModule("dsec_cli.push._known", "push/_known.c",
                   "known chunks are held as Python tuples in a dict"),
    CompiledModule("dsec_cli.run.lazy._fuseloop", "run/lazy/_fuseloop.c",
                   "lazy mounts answer every request in Python", off="DSEC_PY_FUSELOOP"),
)

#: the function that reports the agent binary, named as the modules are
AGENT_STATUS = "dsec_cli.backends.sandbox_agent:agent_status"


def module_status(part: CompiledModule) -> dict[str, Any]:
    """Whether ``part`` is live here: ``state`` is live, off (its DSEC_* setting is set),
    not built (no module beside its source) or import error (built, but it does not load:
    a build for another Python, or a missing symbol), with ``detail`` saying which."""
    row: dict[str, Any] = {"name": part.module.rpartition(".")[2], "module": part.module,
                           "source": part.source, "fallback": part.fallback}
    error: ImportError | None = None
    try:
        spec = importlib.util.find_spec(part.module)
    except ImportError as e:  # its package does not import: nothing of it runs
        spec, error = None, e
    if spec is None:
        row.update(state="not built" if error is None else "import error",
                   live=False, path=None, detail=str(error or "no module beside its source"))
        return row
    row["path"] = spec.origin
    try:
        importlib.import_module(part.module)
    except ImportError as e:
        row.update(state="import error", live=False, detail=str(e))
        return row
    if part.off and env(part.off):
        row.update(state="off", live=False, detail=f"${part.off} is set")
        return row
    row.update(state="live", live=True, detail="")
    return row


def compiled_status() -> dict[str, Any]:
    """Every compiled part of this installation: ``modules`` (one `module_status` row each,
    in `MODULES` order) and ``agent`` (where the in-sandbox agent binary comes from)."""
    where, _, name = AGENT_STATUS.partition(":")
    agent = getattr(importlib.import_module(where), name)()
    modules = [module_status(m) for m in MODULES]
    return {"modules": modules, "agent": agent,
            "all_live": all(m["live"] for m in modules) and bool(agent["live"])}
