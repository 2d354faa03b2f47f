"""The `dsec` command line: thin typer commands that call the SDK and render results.

Only this package prints and exits. Each submodule registers the commands of one area; the
table below names them so that `dsec --help` and every command start without importing the
other areas (group.py builds the typer app and loads a command's module on first use), and
fast.py runs the plain forms of the hot commands without typer at all.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core.errors import DsecError
from .commands import COMMANDS, root_help
from .text import terminal_safe

__all__ = ["COMMANDS", "main", "root_help", "terminal_safe"]

def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, built on first use
        from .group import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_argv(argv: list[str]) -> None:
    """Arguments are text: bytes that are not UTF-8 (which Python keeps as lone surrogates)
    would fail somewhere deep, or reach a node as something else, so they stop here."""
    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            from ..core.errors import UsageError
            from ..core.validate import shown

            raise UsageError(f"argument {i} {shown(arg)} is not valid UTF-8",
                             hint="dsec takes names, references, paths and commands as UTF-8"
                             ) from None


def _served(argv: list[str], setting: str | None) -> int | None:
    """The exit code of ``argv`` run by the command server (server.py), when it takes it;
    None to run it here."""
    if not argv or argv[0] not in ("exec", "run", "ps"):
        return None
    from . import served

    idle = served.idle_seconds(setting)
    if idle is None:
        return None
    try:
        return served.try_run(argv, idle, eager=setting is not None)
    except served.ServerGone:
        raise DsecError("the dsec command server stopped before the command finished; it was "
                        "not run again", hint="run it again: a new server starts, or set "
                        "DSEC_CLI_SERVER=0 to run commands in-process") from None


def main() -> None:
    if sys.argv[1:] in ([], ["--help"]):  # the root help needs no command module, nor typer
        sys.stdout.write(root_help())
        if not sys.argv[1:]:
            sys.exit(2)  # no command is a usage error, as click has it
        return
    from ..core.settings import env  # not config.py: a served call needs none of it

    try:
        _check_argv(sys.argv[1:])
        code = _served(sys.argv[1:], env("DSEC_CLI_SERVER"))
        if code is not None:
            sys.exit(code)
        import logging  # after the command server's turn: a served command never logs here

        level = (env("DSEC_LOG") or "WARNING").upper()
        if level not in logging.getLevelNamesMapping():
            level = "WARNING"  # a mistyped DSEC_LOG must not stop the command
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        from . import fast

        code = fast.run(sys.argv[1:])  # plain hot commands (exec, run -d, ps, build) skip typer
        if code is not None:
            sys.exit(code)
        from .group import app

        app()  # click renders its own usage errors (exit 2)
    except DsecError as e:
        from .render import print_error

        print_error(e)
        sys.exit(e.exit_code)
