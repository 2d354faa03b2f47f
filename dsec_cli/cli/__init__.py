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

#: command -> (module in this package that registers it, one-line help). A module that adds
#: commands adds its lines here; tests/test_cli_start.py checks the table against what every
#: module of this package registers.
COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("build", "Build layer and image specs (default: layerspecs/), or a Dockerfile with "
              "--as, into a store."),
    "ls": ("build", "List layers and images in a store."),
    "inspect": ("build", "Show a layer's or image's manifest and index, or a sandbox's state."),
    "export": ("build", "Write an image's merged tree (whiteouts applied) to a directory or a "
                        "tar, or the image as a runnable OCI image (--format oci, "
                        "--to-registry)."),
    "version": ("build", "Print the dsec version."),
    "push": ("store", "Copy layers or images (with their layers) to a store; sends only what it "
                      "lacks."),
    "pull": ("store", "Copy layers or images from a store into the local one; verifies "
                      "everything read."),
    "rmi": ("store", "Remove layer or image refs; `dsec gc` frees what only they reached."),
    "run": ("sandbox", "Create a sandbox; run CMD in it and remove it, or leave it running with "
                       "-d."),
    "exec": ("sandbox", "Run a command in a sandbox: streams output, forwards stdin, exits with "
                        "its code."),
    "cp": ("sandbox", "Copy a file into a sandbox, or a file, symlink or directory out of one "
                      "(one side is [NODE/]SANDBOX:PATH)."),
    "ps": ("sandbox", "List sandboxes: this node's, a cluster node's (--node) or every node's "
                      "(--all-nodes, in parallel; a node that does not answer is reported and "
                      "skipped)."),
    "rm": ("sandbox", "Remove sandboxes (stops everything they run)."),
    "pause": ("sandbox", "Freeze every process of a sandbox (cgroup freezer)."),
    "resume": ("sandbox", "Thaw a paused sandbox."),
    "snapshot": ("sandbox", "Turn a sandbox's changes into a new layer and an image stacking it."),
    "fork": ("sandbox", "Make copies of a sandbox's files: new sandboxes on its node, "
                        "copy-on-write over one snapshot layer where the backend snapshots; "
                        "prints the copies' ids."),
    "gc": ("gc", "Delete what nothing references: store objects no ref or pin reaches (safe "
                 "while others push), and with --node this node's expired sandboxes and least "
                 "recently used layers."),
    "agent": ("node", "The node service of the cluster: serves the node protocol for `dsec "
                      "--node`."),
    "node": ("node", "Cluster nodes reached over SSH (each runs `dsec agent`)."),
    "optimize": ("optimize", "Profiled prefetch: record what IMAGE reads at start (from earlier "
                             "`dsec run --fetch lazy` runs, or by running CMD now) and publish "
                             "layer versions that prefetch it."),
    "verify": ("verify", "Check the objects reachable from refs: one line per bad object, then "
                         "counts."),
    "import": ("oci", "Import OCI or Docker images: each layer becomes a dsec layer, each "
                      "config an image."),
    "journal": ("job", "A rollout's steps (number, key, command, exit code, state digests, "
                       "duration) and its grades (reward, tests passed and failed, tamper)."),
    "replay": ("job", "Rebuild a rollout in a fresh sandbox: its image, its last snapshot, and "
                      "the journal's later steps re-executed with their state digests checked."),
    "job": ("job", "Jobs: sandboxes owned through a lease, with a journal of every exec "
                   "(docs/jobs.md)."),
    "pool": ("pool", "Warm pools: sandboxes made ahead, taken by creates with the same image, "
                     "backend, limits and environment."),
    "git-scrub": ("grade", "Write a new layer: REF with the git repository at --path reduced "
                           "to one commit holding --base's tree (no other commits, tags, "
                           "reflogs, remotes or stray objects)."),
    "git-check": ("grade", "Exit 0 when the repository at --path holds one parentless commit "
                           "and nothing beyond it; else list what reaches past it and exit 1."),
    "start-task": ("grade", "Record the digests of the task's protected paths now (after "
                            "setup, before the agent acts); `dsec grade` reports what the "
                            "agent changed, created or deleted since."),
    "grade": ("grade", "Score SANDBOX in a fork: the task image plus the grader's hidden "
                       "tests, only the agent's changes on the patch surface, no network."),
    "egress": ("grade", "Replace a running sandbox's egress allowlist, enforced on the host's "
                        "side."),
    "park": ("density", "Stop a sandbox and give its memory back (to swap where the node has "
                        "swap)."),
    "thaw": ("density", "Let a parked sandbox run again: the same files and processes."),
    "top": ("density", "Per sandbox: CPU, resident, declared, reclaimed and swapped memory, "
                       "class, idle time; refreshed live on a terminal, one sample with --json "
                       "or --once."),
}

ABOUT = "Content-addressed layers and sandboxes for agentic-RL environments."


def root_help() -> str:
    """`dsec --help`, from the table alone (no command module, typer or rich imported)."""
    import shutil
    import textwrap

    width = max(map(len, COMMANDS)) + 2
    cols = max(60, min(shutil.get_terminal_size().columns, 100))
    lines = ["Usage: dsec [OPTIONS] COMMAND [ARGS]...", "", f"  {ABOUT}", "", "Options:",
             f"  {'--help':<{width}}Show this message and exit.", "", "Commands:"]
    for name, (_, short) in COMMANDS.items():
        lines += textwrap.wrap(short, cols, initial_indent=f"  {name:<{width}}",
                               subsequent_indent=" " * (width + 2))
    return "\n".join(lines) + "\n"


def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, built on first use
        from .group import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: longest error message printed whole; longer ones quote a huge input and are cut
MAX_MESSAGE = 2000


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


#: what a terminal would act on rather than show: C0 controls but tab and newline (ESC
#: starts a sequence that can retitle the window, clear the screen or move the cursor), DEL,
#: the C1 controls (U+009B is a CSI of its own) and the bidirectional overrides and isolates
#: (they reorder what is shown)
_CONTROL = "[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]"


def terminal_safe(text: str) -> str:
    """``text`` as it may reach a terminal: each control character shown escaped (``\\x1b``,
    ``\\u202e``), bytes that are not UTF-8 (lone surrogates) likewise. Error messages quote
    what nodes, store objects, sandboxes and images said: it is shown, never obeyed."""
    import re  # only when an error is shown: a command's start does not pay for it

    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return re.sub(_CONTROL, lambda m: m.group().encode("unicode_escape").decode("ascii"),
                  text)


def _print_error(e: DsecError) -> None:
    """The one printer of errors, for every command: the message and hint shown as text,
    never parsed as rich markup or emoji codes (``[bold]`` from a node prints as it is) nor
    passed to the terminal as controls."""
    from rich.text import Text

    from .render import err_console

    message = str(e.message)
    if len(message) > MAX_MESSAGE:
        message = f"{message[:MAX_MESSAGE]}... (message cut at {MAX_MESSAGE} characters)"
    err_console().print(Text.assemble(("error:", "bold red"), " ", terminal_safe(message)),
                        highlight=False)
    if e.hint:
        hint = terminal_safe(str(e.hint)[:MAX_MESSAGE])
        err_console().print(Text.assemble(("hint:", "dim"), " ", hint), highlight=False)


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
        _print_error(e)
        sys.exit(e.exit_code)
