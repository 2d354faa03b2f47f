"""The fast launcher (dsec_cli/cli/fast.py): plain `exec`, `run -d` and `ps` run without typer,
rich or the remote-store libraries, and give what the typer commands give; every other form
goes to typer unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsec_cli.cli import fast

from .conftest import IMAGE, leaks

#: what a plain hot command must not import
HEAVY = ("typer", "click", "pydantic", "rich", "boto3", "botocore", "oras", "yaml",
         "dsec_cli.backends.fnpool", "dsec_cli.cli.group", "dsec_cli.cli.sandbox")


def _run(env: dict[str, str], argv: list[str], via_typer: bool = False,
         input: bytes | None = None) -> tuple[int, bytes, bytes, list[str]]:
    """`dsec ARGV` in a fresh interpreter (through typer when asked); exit code, output,
    and the HEAVY modules loaded at exit."""
    entry = ("from dsec_cli.cli.group import app\napp()\n" if via_typer else
             "from dsec_cli.cli import main\nmain()\n")
    code = ("import atexit, json, os, sys\n"
            f"heavy = {HEAVY!r}\n"
            "atexit.register(lambda: os.write(2, ('\\nLOADED ' + json.dumps("
            "sorted(m for m in heavy if m in sys.modules)) + '\\n').encode()))\n"
            "sys.argv = ['dsec', *sys.argv[1:]]\n" + entry)
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, input=input,
                       env={**os.environ, **env}, timeout=300)
    err, _, loaded = p.stderr.rpartition(b"\nLOADED ")
    return p.returncode, p.stdout, err, json.loads(loaded)


def test_plain_hot_commands_skip_typer_and_match_it(node_env: dict[str, str]) -> None:
    rc, out, err, loaded = _run(node_env, ["run", "-d", "--memory", "64M", IMAGE])
    assert rc == 0, err
    assert loaded == [], loaded
    sid = out.decode().strip()
    try:
        argv = ["exec", "-e", "A=1", "--workdir=/etc", sid, "--", "sh", "-c",
                "cat; echo $A; pwd; echo err >&2; exit 3"]
        fast_run = _run(node_env, argv, input=b"piped\n")
        typer_run = _run(node_env, argv, via_typer=True, input=b"piped\n")
        assert fast_run[0] == typer_run[0] == 3
        assert fast_run[1] == typer_run[1] == b"piped\n1\n/etc\n"
        assert fast_run[2].strip() == typer_run[2].strip() == b"err"
        assert fast_run[3] == [], fast_run[3]
        rc, out, err, loaded = _run(node_env, ["ps", "--json"])
        assert rc == 0 and loaded == [], (err, loaded)
        assert [r["id"] for r in json.loads(out)] == [sid]
        # a sandbox error exits as through typer, with the message
        rc, _, err, _ = _run(node_env, ["exec", "nosuchid", "--", "true"])
        assert rc == 2 and b"no sandbox" in err
    finally:
        subprocess.run([sys.executable, "-m", "dsec_cli", "rm", sid],
                       env={**os.environ, **node_env}, check=True, capture_output=True)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_usage_errors_still_come_from_typer(node_env: dict[str, str]) -> None:
    for argv in (["exec", "x", "--", "true", "--timeout"],  # after --: the command's own
                 ["exec", "--timeout", "soon", "x", "--", "true"],
                 ["run", "-d", "--pids", "many", IMAGE]):
        rc, _, err, loaded = _run(node_env, argv)
        if argv[-1] == "--timeout":
            assert rc == 2 and b"no sandbox" in err  # parsed by the launcher: x is looked up
            continue
        assert rc == 2, (argv, err)
        assert "typer" in loaded  # refused by typer's own parser, with its usage message
        assert b"Usage" in err or b"Invalid value" in err, err


@pytest.mark.parametrize("argv", [
    ["exec", "ID"],                          # no command
    ["exec", "ID", "ls"],                    # a command without --: typer decides
    ["exec", "ID", "--", ],                  # empty command
    ["exec", "--help"],
    ["exec", "--bogus", "ID", "--", "true"],
    ["exec", "--timeout", "1e3", "ID", "--", "true"],  # a float typer may read otherwise
    ["exec", "-we", "ID", "--", "true"],     # bundled short options
    ["run", IMAGE, "--", "true"],            # run without -d
    ["run", "-d", IMAGE, "--", "true"],
    ["run", "-d", "--detach=1", IMAGE],
    ["ps", "extra"],
    ["ps", "--json", "--", "x"],
    ["rm", "ID"],
    [],
])
def test_launcher_leaves_other_forms_to_typer(argv: list[str]) -> None:
    assert fast.run(argv) is None


def test_launcher_parses_plain_forms() -> None:
    opts, pos, cmd = fast._parse(["--node", "n1", "-e", "A=1", "--env=B=2", "--timeout", "2.5",
                                  "--json", "ID", "--", "ls", "--all"], fast._EXEC)
    assert opts == {"node": "n1", "env": ["A=1", "B=2"], "timeout": 2.5, "json_out": True}
    assert pos == ["ID"] and cmd == ["ls", "--all"]
    opts, pos, cmd = fast._parse(["-d", "-b", "fncall", "--cpus", "0.5", "--pids", "64", IMAGE],
                                 fast._RUN)
    assert opts == {"detach": True, "backend": "fncall", "cpus": 0.5, "pids": 64}
    assert pos == [IMAGE] and cmd is None
