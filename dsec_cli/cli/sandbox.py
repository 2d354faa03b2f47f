"""Sandbox commands: run, exec, cp, ps, rm, pause, resume, snapshot, fork (thin: parse, call
dsec_cli.api.sandboxes, which routes NODE/ID ids and --node, render)."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Any

import typer

STATE_HELP = "node state directory (default: DSEC_STATE_DIR or the config's state_dir)"
#: bytes of each of stdout and stderr that `--json` puts in its document; past it the
#: field holds the first JSON_OUTPUT_LIMIT bytes and `stdout_truncated` / `stderr_truncated`
#: say so (without --json, output streams through and nothing is kept)
JSON_OUTPUT_LIMIT = 8 << 20


def _stream(kind: str, data: bytes) -> None:
    out = sys.stdout.buffer if kind == "stdout" else sys.stderr.buffer
    out.write(data)
    out.flush()


def _stdin_source() -> Any:
    """Stdin chunks when stdin is a pipe or file (a terminal is not forwarded)."""
    if sys.stdin is None or sys.stdin.isatty():
        return None

    def chunks() -> Any:
        # raw reads of fd 0 (no buffered reader whose lock a still-blocked feeder thread
        # would hold at interpreter shutdown)
        while True:
            b = os.read(0, 1 << 20)
            if not b:
                return
            yield b

    return chunks()


def _parse_env(items: list[str] | None) -> dict[str, str]:
    from ..core.errors import UsageError

    env: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"invalid --env {item!r}: expected KEY=VALUE")
        env[k] = v
    return env


def _report(res: Any, json_out: bool, sid: str | None = None) -> None:
    from .render import err_console, print_json

    if json_out:
        doc = {"exit_code": res.exit_code, "stdout": res.stdout.decode(errors="replace"),
               "stderr": res.stderr.decode(errors="replace"), "duration": res.duration,
               "timed_out": res.timed_out, "oom_killed": res.oom_killed,
               "stdout_truncated": res.stdout_truncated,
               "stderr_truncated": res.stderr_truncated}
        if sid:
            doc["id"] = sid
        print_json(doc)
    if res.timed_out:
        err_console().print("[yellow]dsec: the command timed out and was killed[/]")
    if res.oom_killed:
        err_console().print("[yellow]dsec: the sandbox's memory limit killed the command[/]")
    if res.pids_limited:
        err_console().print("[yellow]dsec: the sandbox hit its process limit[/]")
    raise typer.Exit(res.exit_code)


JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
StateOpt = Annotated[str | None, typer.Option("--state-dir", help=STATE_HELP)]  # noqa: UP007
EnvOpt = Annotated[list[str] | None,  # noqa: UP007
                   typer.Option("--env", "-e", help="KEY=VALUE (repeatable)")]
WorkdirOpt = Annotated[str | None, typer.Option("--workdir", "-w")]  # noqa: UP007
TimeoutOpt = Annotated[float | None,  # noqa: UP007
                       typer.Option(help="kill the command after this many seconds")]
SandboxArg = Annotated[str, typer.Argument(help="sandbox id (a unique prefix is enough)")]
CmdArg = Annotated[list[str] | None, typer.Argument(help="command to run (after --)")]  # noqa: UP007
NodeOpt = Annotated[str | None, typer.Option(  # noqa: UP007
    "--node", help="cluster node NAME, or local (ids NODE/ID name their node)")]


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"ignore_unknown_options": True})
    def run(
        image: Annotated[str, typer.Argument(help="image (NAME@VERSION, digest) or rootfs dir")],
        cmd: CmdArg = None,
        backend: Annotated[str, typer.Option("--backend", "-b",
                                             help="container | fncall | microvm | vm")
                           ] = "container",
        cpus: Annotated[float | None, typer.Option(help="CPU share, e.g. 0.5 or 2")  # noqa: UP007
                        ] = None,
        memory: Annotated[str | None, typer.Option(help="memory limit, e.g. 512M")  # noqa: UP007
                          ] = None,
        pids: Annotated[int | None, typer.Option(help="maximum number of processes")  # noqa: UP007
                        ] = None,
        ttl: Annotated[str | None,  # noqa: UP007
                       typer.Option(help="remove after this long (dsec gc --node), e.g. 30m")
                       ] = None,
        network: Annotated[str, typer.Option(help="none (loopback only) | host")] = "none",
        disk: Annotated[str | None, typer.Option(  # noqa: UP007
            help="what the sandbox may write, e.g. 1G (past it: ENOSPC inside)")] = None,
        env: EnvOpt = None,
        workdir: WorkdirOpt = None,
        timeout: TimeoutOpt = None,
        detach: Annotated[bool, typer.Option("--detach", "-d",
                                             help="print the id and leave it running")
                          ] = False,
        fetch: Annotated[str, typer.Option(
            "--fetch", help="auto (the fastest start here: see `dsec node check`) | eager "
                            "(fetch every layer first) | lazy (mount now, fetch files on first "
                            "read) | background (lazy, plus a full fetch behind it)")
                         ] = "auto",
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node_name: Annotated[str | None, typer.Option(  # noqa: UP007
            "--node", help="cluster node NAME, auto (placed by capacity and cache) or local")
                             ] = None,
    ) -> None:
        """Create a sandbox; run CMD in it and remove it, or leave it running with -d."""
        from ..api import sandboxes
        from ..core import validate
        from ..core.errors import UsageError
        from .render import print_json

        validate.image(image)
        validate.node_option(node_name)
        validate.positive_float(timeout, "--timeout")
        if not detach and not cmd:
            raise UsageError("give a command after -- or use -d to leave the sandbox running")
        opts = sandboxes.create_options(backend, cpus=cpus, memory=memory, pids=pids, ttl=ttl,
                                        network=network, env=_parse_env(env), workdir=workdir,
                                        fetch=fetch, disk=disk, prefix="--")
        node, rec = sandboxes.create(image, opts, node_name, state_dir)
        if detach:
            if cmd:
                node.exec(rec.id, cmd, timeout=timeout, capture_limit=0)
            if json_out:
                print_json(rec.public())
            else:
                typer.echo(rec.id)
            return
        assert cmd
        try:
            res = node.exec(rec.id, cmd, stdin=_stdin_source(), timeout=timeout,
                            on_output=None if json_out else _stream,
                            capture_limit=JSON_OUTPUT_LIMIT if json_out else 0)
        finally:
            node.remove(rec.id)
        _report(res, json_out, rec.id)

    @app.command("exec", context_settings={"ignore_unknown_options": True})
    def exec_(
        sandbox: SandboxArg,
        cmd: CmdArg = None,
        env: EnvOpt = None,
        workdir: WorkdirOpt = None,
        timeout: TimeoutOpt = None,
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Run a command in a sandbox: streams output, forwards stdin, exits with its code."""
        from ..api.sandboxes import exec_in
        from ..core import validate
        from ..core.errors import UsageError

        validate.positive_float(timeout, "--timeout")
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if not cmd:
            raise UsageError("exec needs a command, e.g. `dsec exec ID -- ls /`")
        res = exec_in(sandbox, cmd, node=node, state_dir=state_dir, env=_parse_env(env),
                      cwd=workdir, stdin=_stdin_source(), timeout=timeout,
                      on_output=None if json_out else _stream,
                      capture_limit=JSON_OUTPUT_LIMIT if json_out else 0)
        _report(res, json_out)

    @app.command()
    def cp(
        src: Annotated[str, typer.Argument(help="host path or SANDBOX:PATH")],
        dst: Annotated[str, typer.Argument(help="host path or SANDBOX:PATH")],
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Copy a file into a sandbox, or a file, symlink or directory out of one (one side
        is [NODE/]SANDBOX:PATH). Out of a sandbox: symlinks stay symlinks, setuid/setgid/
        sticky bits are dropped, FIFOs, sockets and devices are refused."""
        from ..api.sandboxes import copy
        from .render import print_json

        result = copy(src, dst, node, state_dir)
        if json_out:
            print_json(result)

    @app.command()
    def ps(json_out: JsonOpt = False, state_dir: StateOpt = None, node: NodeOpt = None,
           all_nodes: Annotated[bool, typer.Option(
               "--all-nodes", help="every configured node, in parallel")] = False) -> None:
        """List sandboxes: this node's, a cluster node's (--node) or every node's
        (--all-nodes, in parallel; a node that does not answer is reported and skipped)."""
        from ..api.sandboxes import ps as list_all
        from .render import print_json

        recs, failed = list_all(state_dir, node, all_nodes=all_nodes)
        if json_out:
            print_json({"sandboxes": recs, "failed": failed} if all_nodes else recs)
        else:
            _ps_table(recs)
        if all_nodes:
            from .node import render_fanout

            render_fanout(failed)  # exits 1 when a node did not answer

    @app.command()
    def rm(
        sandboxes: Annotated[list[str], typer.Argument(help="sandbox ids")],
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Remove sandboxes (stops everything they run)."""
        from ..api.sandboxes import remove
        from .render import print_json

        removed = remove(sandboxes, node, state_dir)  # all ids looked up before any goes
        if json_out:
            print_json({"removed": removed})
        else:
            for sid in removed:
                typer.echo(sid)

    @app.command()
    def pause(sandbox: SandboxArg, json_out: JsonOpt = False, state_dir: StateOpt = None,
              node: NodeOpt = None) -> None:
        """Freeze every process of a sandbox (cgroup freezer)."""
        from ..api.sandboxes import pause as pause_sandbox

        _status(pause_sandbox(sandbox, node, state_dir), json_out)

    @app.command()
    def resume(sandbox: SandboxArg, json_out: JsonOpt = False, state_dir: StateOpt = None,
               node: NodeOpt = None) -> None:
        """Thaw a paused sandbox."""
        from ..api.sandboxes import resume as resume_sandbox

        _status(resume_sandbox(sandbox, node, state_dir), json_out)

    @app.command()
    def snapshot(
        sandbox: SandboxArg,
        as_: Annotated[str, typer.Option("--as", help="NAME@VERSION of the new image")],
        push: Annotated[str | None,  # noqa: UP007
                        typer.Option("--push", help="also push the image to this store URL")
                        ] = None,
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Turn a sandbox's changes into a new layer and an image stacking it."""
        from ..api.sandboxes import snapshot as snapshot_sandbox
        from .render import print_json

        out = snapshot_sandbox(sandbox, as_, push, node, state_dir)
        if json_out:
            print_json(out)
        else:
            for w in out.get("warnings", []):
                typer.echo(f"warning: {w}", err=True)
            typer.echo(f"{out['image']} {out['image_digest'][:12]} "
                       f"(layer {out['layer']} {out['layer_digest'][:12]})")

    @app.command()
    def fork(
        sandbox: SandboxArg,
        count: Annotated[int, typer.Option("-n", "--count",
                                           help="how many copies to make (1-256)")] = 1,
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Make copies of a sandbox's files: new sandboxes on its node, copy-on-write over one
        snapshot layer where the backend snapshots; prints the copies' ids."""
        from ..api.sandboxes import fork as fork_sandbox
        from .render import print_json

        out = fork_sandbox(sandbox, count, node, state_dir)
        copies = [r.public() for r in out["copies"]]
        if json_out:
            print_json({**out, "copies": copies})
        else:
            for c in copies:
                typer.echo(c["id"])


def _ps_table(recs: list[dict[str, Any]]) -> None:
    from .render import table

    t = time.time()
    rows = [(r["id"], r["backend"], r["image"], r["status"], f"{t - r['created']:.0f}s",
             "" if r["expires"] is None else f"{max(0, r['expires'] - t):.0f}s")
            for r in recs]
    table(None, ["ID", "BACKEND", "IMAGE", "STATUS", "AGE", "TTL LEFT"], rows)


def _status(rec: Any, json_out: bool) -> None:
    from .render import print_json

    if json_out:
        print_json(rec.public())
    else:
        typer.echo(f"{rec.id} {rec.status}")

