"""Rendering helpers shared by commands: JSON for scripts, rich tables and progress for people."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from ..core.errors import DsecError
from .text import terminal_safe

if TYPE_CHECKING:
    from rich.console import Console

# rich is imported where it draws, not here: a command that prints plain text or JSON (exec,
# run -d, --json) never pays for it


@cache
def console() -> Console:
    from rich.console import Console

    return Console()


@cache
def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def _may_be_terminal(stream: Any = None, forced: tuple[str, ...] = (
        "TTY_COMPATIBLE", "FORCE_COLOR", "FORCE_TERMINAL")) -> bool:
    """False where rich would surely not see a terminal on ``stream`` (default: stderr):
    not a tty, and none of the ``forced`` variables that make it draw anyway. A piped build
    then never imports rich before its work starts."""
    if any(v in os.environ for v in forced):
        return True
    try:
        return bool((sys.stderr if stream is None else stream).isatty())
    except (AttributeError, ValueError):
        return False


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def prepare_table() -> None:
    """Import the table renderer on a thread of its own, for a command that draws a table
    after long work: the import (about 30 ms) then runs while the work waits on other
    threads or the kernel, not after it."""
    import threading

    threading.Thread(target=_import_table, name="dsec-render-import", daemon=True).start()


def _import_table() -> None:
    import rich.console  # noqa: F401
    import rich.table  # noqa: F401


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Cells are text: never rich markup, control characters escaped (they quote names,
    labels and what nodes said). No cell is ever cut: on a terminal a long cell folds onto
    more lines; piped, the table is plain padded columns, one row a line (`grep ID` finds
    the whole id)."""
    cells = [[("" if v is None else terminal_safe(str(v))) for v in r] for r in rows]
    if not _may_be_terminal(sys.stdout, ("TTY_COMPATIBLE", "FORCE_TERMINAL")):
        _plain_table(title, list(columns), cells)
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, show_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in cells:
        t.add_row(*(Text(v) for v in r))
    console().print(t)


def _plain_table(title: str | None, columns: list[str], rows: list[list[str]]) -> None:
    """As `docker ps` prints to a pipe: a header, columns padded to their widest cell and
    three spaces apart, trailing blanks dropped."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    out = [title] if title else []
    for r in [columns, *rows]:
        out.append("   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    sys.stdout.write("\n".join(out) + "\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def progress(enabled: bool = True) -> Iterator[Any]:
    """A rich Progress on a terminal (stderr), or None when output is piped or --json.

    Tasks added with ``unit="bytes"`` show sizes and MB/s; others show counts."""
    if not enabled or not _may_be_terminal() or not err_console().is_terminal:
        yield None
        return
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Amount(ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.fields.get("unit") == "bytes":
                speed = task.speed or 0
                return Text(f"{human_bytes(task.completed)}  {speed / 1e6:.0f} MB/s")
            return Text(f"{task.completed:.0f}")

    with Progress(TextColumn("{task.description}"), BarColumn(), Amount(), TimeElapsedColumn(),
                  console=err_console(), transient=True) as p:
        yield p


#: longest error message printed whole; longer ones quote a huge input and are cut
MAX_MESSAGE = 2000


def print_error(e: DsecError) -> None:
    """The one printer of errors, for every command: the message and hint shown as text,
    never parsed as rich markup or emoji codes (``[bold]`` from a node prints as it is) nor
    passed to the terminal as controls."""
    from rich.text import Text

    message = str(e.message)
    if len(message) > MAX_MESSAGE:
        message = f"{message[:MAX_MESSAGE]}... (message cut at {MAX_MESSAGE} characters)"
    err_console().print(Text.assemble(("error:", "bold red"), " ", terminal_safe(message)),
                        highlight=False)
    if e.hint:
        hint = terminal_safe(str(e.hint)[:MAX_MESSAGE])
        err_console().print(Text.assemble(("hint:", "dim"), " ", hint), highlight=False)
