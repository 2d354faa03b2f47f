"""The `dsec` command line: thin typer commands that call the SDK and render results.

Only this package prints and exits. Each submodule registers the commands of one area.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from ..core.errors import DsecError
from . import build as _build
from . import gc as _gc
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


for _module in (_build, _store, _sandbox, _gc, _node, _optimize, _verify):
    _module.register(app)


def main() -> None:
    from .render import err_console

    level = os.environ.get("DSEC_LOG", "WARNING").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()  # click renders its own usage errors (exit 2)
    except DsecError as e:
        from rich.markup import escape  # messages quote URLs and input: never markup

        err_console().print(f"[bold red]error:[/] {escape(e.message)}", highlight=False)
        if e.hint:
            err_console().print(f"[dim]hint:[/] {escape(e.hint)}", highlight=False)
        sys.exit(e.exit_code)
