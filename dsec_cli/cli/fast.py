"""The fast launcher: the hot commands a script calls in a loop (`dsec exec ID -- CMD`,
`dsec run -d IMAGE`, `dsec ps`, and `dsec build`, whose no-op rebuild is mostly start-up)
parsed here without typer (whose import and per-option validation cost more than the command
itself), then run by the same code as their typer commands (sandbox_io.py, build_io.py).

Only plain forms are taken: known options (``--name VALUE``, ``--name=VALUE``, ``-x VALUE``),
values that parse exactly, and the positionals the command expects. Anything else (``--help``,
a typo, an unusual value, `run` without ``-d``) returns None and the typer application parses
the command line, so its usage errors and help stay the only ones.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"\A[0-9]+(\.[0-9]+)?\Z")
_INT = re.compile(r"\A[0-9]+\Z")

# option spellings -> (parameter, kind); kinds: flag, str, list (repeatable), float, int
_COMMON: dict[str, tuple[str, str]] = {"--json": ("json_out", "flag"),
                                       "--state-dir": ("state_dir", "str")}
_EXEC = {**_COMMON, "--node": ("node", "str"), "--env": ("env", "list"), "-e": ("env", "list"),
         "--workdir": ("workdir", "str"), "-w": ("workdir", "str"),
         "--timeout": ("timeout", "float")}
_RUN = {**_EXEC, "--node": ("node_name", "str"), "--backend": ("backend", "str"),
        "-b": ("backend", "str"), "--cpus": ("cpus", "float"), "--memory": ("memory", "str"),
        "--pids": ("pids", "int"), "--ttl": ("ttl", "str"), "--network": ("network", "str"),
        "--egress": ("egress", "list"), "--disk": ("disk", "str"), "--fetch": ("fetch", "str"),
        "--detach": ("detach", "flag"), "-d": ("detach", "flag")}
_PS = {**_COMMON, "--node": ("node", "str"), "--all-nodes": ("all_nodes", "flag")}
_BUILD = {"--json": ("json_out", "flag"), "--store": ("store", "str"), "--force": ("force", "flag"),
          "--replace": ("replace", "flag"), "--chunk-sha256": ("chunk_sha256", "flag")}


class _NotPlain(Exception):
    """The command line is not in a form this parser takes: typer parses it."""


def _value(kind: str, text: str) -> Any:
    if kind == "float" and _NUMBER.match(text):
        return float(text)
    if kind == "int" and _INT.match(text):
        return int(text)
    if kind in ("str", "list") and text:
        return text
    raise _NotPlain(text)


def _parse(args: list[str], spec: dict[str, tuple[str, str]]
           ) -> tuple[dict[str, Any], list[str], list[str] | None]:
    """Options, positionals, and what follows ``--`` (None when there is no ``--``)."""
    opts: dict[str, Any] = {}
    pos: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if a == "--":
            return opts, pos, args[i:]
        if not a.startswith("-") or a == "-":
            pos.append(a)
            continue
        name, eq, inline = a.partition("=")
        if name not in spec or (eq and not name.startswith("--")):
            raise _NotPlain(a)
        param, kind = spec[name]
        if kind == "flag":
            if eq:
                raise _NotPlain(a)
            opts[param] = True
            continue
        if not eq:
            if i >= len(args):
                raise _NotPlain(a)
            inline = args[i]
            i += 1
        value = _value(kind, inline)
        if kind == "list":
            opts.setdefault(param, []).append(value)
        else:
            opts[param] = value
    return opts, pos, None


def _exec(args: list[str]) -> int:
    from .sandbox_io import exec_command

    opts, pos, cmd = _parse(args, _EXEC)
    if len(pos) != 1 or not cmd:
        raise _NotPlain("exec")
    return exec_command(pos[0], cmd, **opts)


def _run(args: list[str]) -> int:
    from .sandbox_io import create_sandbox

    opts, pos, cmd = _parse(args, _RUN)
    json_out = opts.pop("json_out", False)
    if len(pos) != 1 or cmd is not None or not opts.pop("detach", False):
        raise _NotPlain("run")
    _, rec = create_sandbox(pos[0], **opts)
    if json_out:
        from .render import print_json

        print_json(rec.public())
    else:
        sys.stdout.write(f"{rec.id}\n")
    return 0


def _ps(args: list[str]) -> int:
    from .sandbox_io import list_sandboxes

    opts, pos, cmd = _parse(args, _PS)
    if pos or cmd is not None:
        raise _NotPlain("ps")
    return list_sandboxes(opts.get("json_out", False), opts.get("state_dir"), opts.get("node"),
                          opts.get("all_nodes", False))


def _build(args: list[str]) -> int:
    from pathlib import Path

    from .build_io import build_command

    opts, pos, cmd = _parse(args, _BUILD)
    if cmd is not None:
        raise _NotPlain("build")
    build_command([Path(p) for p in pos] or None, **opts)
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"exec": _exec, "run": _run, "ps": _ps,
                                                   "build": _build}


def run(argv: list[str]) -> int | None:
    """Run ``argv`` if it is a plain hot command; its exit code, or None for typer."""
    fn = COMMANDS.get(argv[0]) if argv else None
    if fn is None:
        return None
    try:
        return fn(argv[1:])
    except _NotPlain:
        return None
