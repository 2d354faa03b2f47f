"""The command line starts with only what a command needs: `dsec --help` and the commands of
one area import no other area's dependencies, and the command table that `--help` is drawn
from says what the command modules register."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: modules only some commands need: the ones a command that does not use them must not load
HEAVY = ("boto3", "botocore", "oras", "rich", "typer", "pydantic", "yaml", "fastcdc",
         "dsec_cli.push.stores.s3", "dsec_cli.oci.store", "dsec_cli.api.sandboxes",
         "dsec_cli.run.node", "dsec_cli.build", "dsec_cli.backends", "tarfile")


def _loaded_after(argv: list[str], env: dict[str, str] | None = None) -> tuple[set[str], str]:
    """Run `dsec ARGV` in a fresh interpreter; the HEAVY modules it had loaded at exit."""
    code = ("import atexit, json, sys\n"
            f"heavy = {HEAVY!r}\n"
            "atexit.register(lambda: sys.__stderr__.write('\\nLOADED ' + json.dumps("
            "sorted(m for m in heavy if m in sys.modules)) + '\\n'))\n"
            "sys.argv = ['dsec', *sys.argv[1:]]\n"
            "from dsec_cli.cli import main\n"
            "main()\n")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       env=env, timeout=120)
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("LOADED ")][-1]
    return set(json.loads(line[len("LOADED "):])), p.stdout


def test_help_loads_no_command_module() -> None:
    loaded, out = _loaded_after(["--help"])
    assert loaded == set(), loaded
    assert "Commands:" in out and "exec" in out


def test_a_store_command_loads_no_sandbox_or_remote_store_code(tmp_path: Path,
                                                              dsec_home: Path) -> None:
    import os

    (tmp_path / "store").mkdir()  # an empty store (a path never written is an error)
    env = {**os.environ, "DSEC_STORE": (tmp_path / "store").as_uri()}
    loaded, out = _loaded_after(["ls", "--json"], env)
    assert json.loads(out) == []
    assert not loaded & {"boto3", "botocore", "oras", "dsec_cli.push.stores.s3",
                         "dsec_cli.oci.store", "dsec_cli.api.sandboxes",
                         "dsec_cli.run.node", "rich"}, loaded


def test_command_table_matches_the_modules() -> None:
    """Every command that a module of dsec_cli/cli registers is in the table with its module
    and one-line help, and nothing else is: a module added without its table entries fails
    here instead of silently missing from `dsec`."""
    import importlib
    import pkgutil

    import typer

    import dsec_cli.cli as cli_pkg
    from dsec_cli.cli import COMMANDS

    seen: dict[str, tuple[str, str]] = {}
    for info in pkgutil.iter_modules(cli_pkg.__path__):
        mod = importlib.import_module(f"dsec_cli.cli.{info.name}")
        if not callable(getattr(mod, "register", None)):
            continue  # helpers (render, group, fast, server, sandbox_io)
        sub = typer.Typer()
        sub.callback()(lambda: None)
        mod.register(sub)
        group = typer.main.get_command(sub)
        for name in group.list_commands(None):  # type: ignore[attr-defined]
            short = group.get_command(None, name).get_short_help_str(limit=1000)  # type: ignore[attr-defined]
            seen[name] = (info.name, short)
    assert seen == COMMANDS


def test_every_command_resolves_and_shows_its_help() -> None:
    from dsec_cli.cli import COMMANDS

    for name in COMMANDS:
        p = subprocess.run([sys.executable, "-m", "dsec_cli", name, "--help"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (name, p.stderr)
        assert "Usage" in p.stdout, name


def test_a_push_between_file_stores_loads_no_remote_store_library(tmp_path: Path,
                                                                  dsec_home: Path) -> None:
    import os

    import dsec_cli

    spec = tmp_path / "s"
    (spec / "files").mkdir(parents=True)
    (spec / "files/x").write_text("x")
    (spec / "l.yaml").write_text('layer: l\nversion: "1"\nsteps:\n'
                                 "  - copy: {src: ./files, dst: /x}\n")
    src, dst = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    dsec_cli.build_specs([spec], src)
    loaded, out = _loaded_after(["push", "l@1", "--to", dst, "--store", src, "--json"],
                                dict(os.environ))
    assert json.loads(out)["objects_sent"] > 0
    assert not loaded & {"boto3", "botocore", "oras", "dsec_cli.push.stores.s3",
                         "dsec_cli.oci.store", "dsec_cli.api.sandboxes",
                         "dsec_cli.run.node", "rich"}, loaded


def test_a_copy_only_build_loads_no_sandbox_or_drawing_code(tmp_path: Path,
                                                            dsec_home: Path) -> None:
    """A build whose specs only copy files starts no sandbox and reads no tarball, and with
    its output piped it draws nothing: none of that code is loaded before (or after) its
    work."""
    import os

    spec = tmp_path / "s"
    (spec / "files").mkdir(parents=True)
    (spec / "files/x").write_text("x")
    (spec / "l.yaml").write_text('layer: l\nversion: "1"\nsteps:\n'
                                 "  - copy: {src: ./files, dst: /x}\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TTY_COMPATIBLE", "FORCE_COLOR", "FORCE_TERMINAL")}
    loaded, out = _loaded_after(["build", str(spec), "--store", (tmp_path / "st").as_uri(),
                                 "--json"], env)
    assert [r["ref"] for r in json.loads(out)["items"]] == ["l@1"], out
    assert "dsec_cli.build" in loaded  # the probe sees what the command loaded
    assert not loaded & {"dsec_cli.backends", "tarfile", "rich", "boto3", "oras", "fastcdc"}, loaded


def test_progress_draws_only_where_rich_sees_a_terminal() -> None:
    """Piped stderr: no progress and rich not imported; where an environment variable makes
    rich draw anyway (FORCE_COLOR), the progress is drawn as before."""
    import os

    code = ("import sys\nfrom dsec_cli.cli import render\n"
            "with render.progress() as p:\n"
            "    found = [type(p).__name__, 'rich' in sys.modules]\n"
            "print(*found)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TTY_COMPATIBLE", "FORCE_COLOR", "FORCE_TERMINAL")}
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120)
    assert piped.stdout.split()[-2:] == ["NoneType", "False"], piped.stdout + piped.stderr
    forced = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**env, "FORCE_COLOR": "1"}, timeout=120)
    assert forced.stdout.split()[-2:] == ["Progress", "True"], forced.stdout + forced.stderr


def test_no_command_prints_the_help_and_exits_2() -> None:
    p = subprocess.run([sys.executable, "-m", "dsec_cli"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Commands:" in p.stdout
