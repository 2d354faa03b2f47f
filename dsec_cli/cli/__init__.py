"""The `dsec` command line: thin typer commands that call the SDK and render results.

Only this package prints and exits. Each submodule registers the commands of one area.
"""

from __future__ import annotations

import logging
import sys

import typer

from ..core.errors import DsecError
from . import build as _build
from . import gc as _gc
from . import grade as _grade
from . import node as _node
from . import optimize as _optimize
from . import sandbox as _sandbox
from . import store as _store
from . import verify as _verify

app = typer.Typer(
    name="dsec",
    help="Content-addressed layers and sandboxes for agentic-RL environments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Content-addressed layers and sandboxes for agentic-RL environments."""


for _module in (_build, _store, _sandbox, _gc, _node, _optimize, _verify,
                _grade):
    _module.register(app)


#: longest error message printed whole; longer ones quote a huge input and are cut
MAX_MESSAGE = 2000


def _check_argv(argv: list[str]) -> None:
    """Arguments are text: bytes that are not UTF-8 (which Python keeps as lone surrogates)
    would fail somewhere deep, or reach a node as something else, so they stop here."""
    from ..core.errors import UsageError
    from ..core.validate import shown

    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"argument {i} {shown(arg)} is not valid UTF-8",
                             hint="dsec takes names, references, paths and commands as UTF-8"
                             ) from None


def _print_error(e: DsecError) -> None:
    from rich.markup import escape  # messages quote URLs and input: never markup

    from .render import err_console

    message = e.message
    if len(message) > MAX_MESSAGE:
        message = f"{message[:MAX_MESSAGE]}... (message cut at {MAX_MESSAGE} characters)"
    err_console().print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    if e.hint:
        err_console().print(f"[dim]hint:[/] {escape(e.hint[:MAX_MESSAGE])}", highlight=False)


def main() -> None:
    from ..core.config import env

    level = (env("DSEC_LOG") or "WARNING").upper()
    if level not in logging.getLevelNamesMapping():
        level = "WARNING"  # a mistyped DSEC_LOG must not stop the command
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_argv(sys.argv[1:])
        app()  # click renders its own usage errors (exit 2)
    except DsecError as e:
        _print_error(e)
        sys.exit(e.exit_code)
