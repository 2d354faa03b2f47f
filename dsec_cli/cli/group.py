"""The typer application behind `dsec`, with its commands loaded on first use.

The root group knows each command's name, module and one-line help from the table in
`dsec_cli.cli.commands.COMMANDS`; a command's module (and through it the SDK modules, boto3, oras,
rich...) is imported only when that command runs or shows its own help. `dsec --help` is
rendered from the table alone.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

import typer
from typer.core import TyperGroup

from .commands import COMMANDS, root_help

SETTINGS: dict[str, Any] = {"add_completion": False, "pretty_exceptions_enable": False}


def _noop() -> None:
    """A callback, so that a module with one command still builds a group."""


@cache
def module_group(module: str) -> Any:
    """The click group of one command module's commands (built once per process)."""
    mod = importlib.import_module(f"{__package__}.{module}")
    sub = typer.Typer(**SETTINGS)
    sub.callback()(_noop)
    mod.register(sub)
    return typer.main.get_command(sub)


class LazyGroup(TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        return module_group(entry[0]).get_command(ctx, cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        formatter.write(root_help())


app = typer.Typer(name="dsec", cls=LazyGroup, no_args_is_help=True,
                  help="Content-addressed layers and sandboxes for agentic-RL environments.",
                  **SETTINGS)


@app.callback()
def _root() -> None:
    """Content-addressed layers and sandboxes for agentic-RL environments."""
