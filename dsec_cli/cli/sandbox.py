"""Sandbox commands: run, exec, cp, ps, rm, pause, resume, snapshot, fork (thin: parse, call
dsec_cli.api.sandboxes, which routes NODE/ID ids and --node, render)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..core.errors import UsageError
from .sandbox_io import (
    JSON_OUTPUT_LIMIT,
    exec_command,
    list_sandboxes,
    report,
    sandbox_options,
    stdin_source,
    stream_output,
)

STATE_HELP = "node state directory (default: DSEC_STATE_DIR or the config's state_dir)"


def _run_in_job(job: str, image: str, opts: Any, cmd: list[str] | None,
                timeout: float | None, json_out: bool, node_name: str | None,
                state_dir: str | None) -> None:
    """`dsec run --job`: the sandbox stays with the job; CMD's output is shown after it ran."""
    from ..api.jobs import run_in_job
    from .render import print_json

    if node_name not in (None, "local"):
        raise UsageError("--job sandboxes run on the job's node: drop --node")
    doc, res = run_in_job(job, image, opts, cmd, timeout, state_dir)
    if json_out:
        print_json({**doc, "result": None if res is None else {
            "exit_code": res.exit_code, "stdout": res.stdout.decode(errors="replace"),
            "stderr": res.stderr.decode(errors="replace"), "duration": res.duration}})
    else:
        typer.echo(doc["sandbox"])
        if res is not None:
            stream_output("stdout", res.stdout)
            stream_output("stderr", res.stderr)
    if res is not None and res.exit_code:
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
UserOpt = Annotated[str | None, typer.Option(  # noqa: UP007
    "--user", "-u", help="run as NAME, UID, NAME:GROUP or UID:GID (default: the image's user)")]
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
        network: Annotated[str, typer.Option(
            help="none (loopback only) | host | allowlist (only what --egress names)")
                           ] = "none",
        egress: Annotated[list[str] | None, typer.Option(  # noqa: UP007
            "--egress", help="with --network allowlist: host:PORT (this node), IPV4:PORT or "
                             "NAME:PORT the sandbox may reach (repeatable)")] = None,
        disk: Annotated[str | None, typer.Option(  # noqa: UP007
            help="what the sandbox may write, e.g. 1G (past it: ENOSPC inside)")] = None,
        env: EnvOpt = None,
        workdir: WorkdirOpt = None,
        user: UserOpt = None,
        entrypoint: Annotated[str | None, typer.Option(  # noqa: UP007
            "--entrypoint", help="replace the image's entrypoint (\"\" for none); the "
                                 "image's cmd is then dropped too")] = None,
        timeout: TimeoutOpt = None,
        detach: Annotated[bool, typer.Option("--detach", "-d",
                                             help="print the id and leave it running")
                          ] = False,
        cpu_class: Annotated[str | None, typer.Option(  # noqa: UP007
            "--class", help="CPU class: latency (exec answers stay fast) | batch (default) | "
                            "idle (only when nothing else wants the CPU)")] = None,
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
        job: Annotated[str | None, typer.Option(  # noqa: UP007
            "--job", help="a job on this node owns the sandbox (it stays; CMD is its first "
                          "journaled step)")] = None,
    ) -> None:
        """Create a sandbox; run CMD in it and remove it, or leave it running with -d.

        Without CMD, the image's entrypoint and cmd run; CMD follows the image's entrypoint,
        as docker does."""
        from .render import print_json

        opts = sandbox_options(image, backend=backend, cpus=cpus, memory=memory, pids=pids,
                               ttl=ttl, network=network, disk=disk, env=env, workdir=workdir,
                               timeout=timeout, fetch=fetch, node_name=node_name,
                               cpu_class=cpu_class, user=user, egress=egress)
        if job is not None:
            _run_in_job(job, image, opts, cmd, timeout, json_out, node_name, state_dir)
            return
        from ..api import sandboxes

        node, rec = sandboxes.create(image, opts, node_name, state_dir)
        if detach:
            if cmd:
                node.exec(rec.id, sandboxes.command_for(rec, cmd, entrypoint), timeout=timeout,
                          capture_limit=0)
            if json_out:
                print_json(rec.public())
            else:
                typer.echo(rec.id)
            return
        try:
            argv = sandboxes.command_for(rec, cmd, entrypoint)
            res = node.exec(rec.id, argv, stdin=stdin_source(), timeout=timeout,
                            on_output=None if json_out else stream_output,
                            capture_limit=JSON_OUTPUT_LIMIT if json_out else 0)
        finally:
            node.remove(rec.id)
        raise typer.Exit(report(res, json_out, rec.id))

    @app.command("exec", context_settings={"ignore_unknown_options": True})
    def exec_(
        sandbox: SandboxArg,
        cmd: CmdArg = None,
        env: EnvOpt = None,
        workdir: WorkdirOpt = None,
        timeout: TimeoutOpt = None,
        user: UserOpt = None,
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Run a command in a sandbox: streams output, forwards stdin, exits with its code."""
        raise typer.Exit(exec_command(sandbox, cmd or [], env=env, workdir=workdir,
                                      timeout=timeout, json_out=json_out,
                                      state_dir=state_dir, node=node, user=user))

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
        raise typer.Exit(list_sandboxes(json_out, state_dir, node, all_nodes))

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
        replace: Annotated[bool, typer.Option(
            "--replace", help="move a NAME@VERSION the store (or --push's) already holds")
        ] = False,
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
    ) -> None:
        """Turn a sandbox's changes into a new layer and an image stacking it.

        Versions are immutable: a NAME@VERSION the store holds is refused without --replace."""
        from ..api.sandboxes import snapshot as snapshot_sandbox
        from .render import print_json

        out = snapshot_sandbox(sandbox, as_, push, node, state_dir, replace=replace)
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


def _status(rec: Any, json_out: bool) -> None:
    from .render import print_json

    if json_out:
        print_json(rec.public())
    else:
        typer.echo(f"{rec.id} {rec.status}")

