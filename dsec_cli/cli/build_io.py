"""The body of `dsec build`, shared by its typer command (cli/build.py) and the fast launcher
(cli/fast.py), which runs a plain `dsec build` without typer: a no-op build is mostly
start-up, and typer's is the larger part of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from .render import err_console, human_bytes, prepare_table, print_json, progress, table
from .text import terminal_safe


def dockerfile_options(specs: list[Path] | None, as_ref: str | None,
                       build_args: list[str] | None, target: str, squash: bool
                       ) -> dict[str, Any]:
    """`images.build`'s options of a Dockerfile build (none for a build of specs)."""
    if as_ref is None:
        if any(p.name == "Dockerfile" or p.name.startswith("Dockerfile.")
               or p.name.lower().endswith(".dockerfile") for p in specs or []):
            raise UsageError("a Dockerfile build needs --as NAME@VERSION")
        return {"build_args": None, "target": target, "squash": squash}
    args = {}
    for item in build_args or []:
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise UsageError(f"--build-arg {item!r}: expected KEY=VALUE")
        args[k] = v
    return {"as_ref": as_ref, "build_args": args, "target": target, "squash": squash}


def build_command(specs: list[Path] | None, store: str | None = None, *, force: bool = False,
                  replace: bool = False, chunk_sha256: bool = False,
                  json_out: bool = False, dockerfile: dict[str, Any] | None = None) -> None:
    from ..api import images

    with progress(not json_out) as p:
        files = p.add_task("files", total=None) if p else None
        data = p.add_task("chunked", total=None, unit="bytes") if p else None

        warm = not json_out  # the table's renderer not yet asked for

        def tick(kind: str, n: int) -> None:
            nonlocal warm
            if warm:  # a layer's data is being written: the table is drawn once it ends
                warm = False
                prepare_table()
            if p is not None:
                p.advance(files if kind == "files" else data, n)

        def log_line(line: str) -> None:
            if not json_out:
                err_console().print(f"  | {line}", style="dim", highlight=False, markup=False)

        report = images.build(specs or None, store, force=force, progress=tick,
                              on_log=log_line, chunk_sha256=chunk_sha256, replace=replace,
                              **(dockerfile or {}))
    if json_out:
        print_json({"store": report.store, "items": [i.__dict__ for i in report.items],
                    "warnings": report.warnings, "pinned": report.pinned})
        return
    rows = [(i.ref, i.kind, i.manifest[:12], "cached" if i.cached else f"{i.seconds:.2f}s",
             human_bytes(i.size), human_bytes(i.stored_size),
             "" if i.cached or i.kind == "image" else human_bytes(i.new_bytes))
            for i in report.items]
    table(f"built into {report.store}", ["ref", "kind", "digest", "time", "size", "stored",
                                         "new"], rows)
    for i in report.items:
        if i.replaced:
            err_console().print(f"replaced: {i.ref} named {i.replaced[:12]}, now "
                                f"{i.manifest[:12]}", highlight=False)
    for source, digest in report.pinned.items():
        err_console().print(f"pinned: {source} at {digest}", highlight=False, markup=False)
    from rich.text import Text


    for w in report.warnings:  # they name store objects and quote their errors: text only
        err_console().print(Text.assemble(("warning:", "yellow"), " ", terminal_safe(w)),
                            highlight=False)
