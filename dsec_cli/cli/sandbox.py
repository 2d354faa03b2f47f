"""Sandbox commands: run, exec, cp, ps, rm, pause, resume, snapshot (thin: parse, call the
node API in dsec_cli.run, render)."""

from __future__ import annotations

import sys
import time
from typing import Any

import typer

STATE_HELP = "Node state directory (default: DSEC_STATE_DIR or the config's state_dir)."


def _node(state_dir: str | None) -> Any:
    from ..run.node import local_node

    return local_node(state_dir)


def _stream(kind: str, data: bytes) -> None:
    out = sys.stdout.buffer if kind == "stdout" else sys.stderr.buffer
    out.write(data)
    out.flush()


def _stdin_source() -> Any:
    """Stdin chunks when stdin is a pipe or file (a terminal is not forwarded)."""
    if sys.stdin is None or sys.stdin.isatty():
        return None

    def chunks() -> Any:
        while True:
            b = sys.stdin.buffer.read1(1 << 20) if hasattr(sys.stdin.buffer, "read1") \
                else sys.stdin.buffer.read(1 << 20)
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
               "timed_out": res.timed_out, "oom_killed": res.oom_killed}
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


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        image: str = typer.Argument(..., help="Image (NAME@VERSION, digest) or a rootfs dir."),
        cmd: list[str] = typer.Argument(None, help="Command to run (after --)."),
        backend: str = typer.Option("container", "--backend", "-b",
                                    help="container | fncall | microvm | vm"),
        cpus: float = typer.Option(None, help="CPU share, e.g. 0.5 or 2."),
        memory: str = typer.Option(None, help="Memory limit, e.g. 512M."),
        pids: int = typer.Option(None, help="Maximum number of processes."),
        ttl: str = typer.Option(None, help="Remove after this long (dsec gc --node), e.g. 30m."),
        network: str = typer.Option("none", help="none (loopback only) | host"),
        env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE (repeatable)."),
        workdir: str = typer.Option(None, "--workdir", "-w"),
        timeout: float = typer.Option(None, help="Kill the command after this many seconds."),
        detach: bool = typer.Option(False, "--detach", "-d", help="Print the id, leave it running."),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Create a sandbox; run CMD in it and remove it, or leave it running with -d."""
        from ..core.config import parse_duration, parse_size
        from ..core.errors import UsageError
        from ..run.node import CreateOptions
        from .render import print_json

        if not detach and not cmd:
            raise UsageError("give a command after -- or use -d to leave the sandbox running")
        opts = CreateOptions(backend=backend, cpus=cpus,
                             memory=parse_size(memory, "--memory") if memory else None,
                             pids=pids, ttl=parse_duration(ttl, "--ttl") if ttl else None,
                             network=network, env=_parse_env(env), workdir=workdir)  # type: ignore[arg-type]
        node = _node(state_dir)
        rec = node.create(image, opts)
        if detach:
            if cmd:
                node.exec(rec.id, cmd, timeout=timeout)
            if json_out:
                print_json(rec.public())
            else:
                typer.echo(rec.id)
            return
        try:
            res = node.exec(rec.id, cmd, stdin=_stdin_source(), timeout=timeout,
                            on_output=None if json_out else _stream)
        finally:
            node.remove(rec.id)
        _report(res, json_out, rec.id)

    @app.command("exec", context_settings={"allow_interspersed_args": False})
    def exec_(
        sandbox: str = typer.Argument(..., help="Sandbox id (a unique prefix is enough)."),
        cmd: list[str] = typer.Argument(..., help="Command to run (after --)."),
        env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE (repeatable)."),
        workdir: str = typer.Option(None, "--workdir", "-w"),
        timeout: float = typer.Option(None, help="Kill the command after this many seconds."),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Run a command in a sandbox: streams output, forwards stdin, exits with its code."""
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        node = _node(state_dir)
        res = node.exec(sandbox, cmd, env=_parse_env(env), cwd=workdir,
                        stdin=_stdin_source(), timeout=timeout,
                        on_output=None if json_out else _stream)
        _report(res, json_out)

    @app.command()
    def cp(
        src: str = typer.Argument(..., help="Host path or SANDBOX:PATH."),
        dst: str = typer.Argument(..., help="Host path or SANDBOX:PATH."),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Copy a file into or out of a sandbox (one side is SANDBOX:PATH)."""
        from ..run.transfer import copy
        from .render import print_json

        result = copy(_node(state_dir), src, dst)
        if json_out:
            print_json(result)

    @app.command()
    def ps(
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """List this node's sandboxes (after reconciling the database with the system)."""
        from .render import print_json, table

        recs = [r.public() for r in _node(state_dir).list()]
        if json_out:
            print_json(recs)
            return
        t = time.time()
        rows = [(r["id"], r["backend"], r["image"], r["status"], f"{t - r['created']:.0f}s",
                 "" if r["expires"] is None else f"{max(0, r['expires'] - t):.0f}s")
                for r in recs]
        table(None, ["ID", "BACKEND", "IMAGE", "STATUS", "AGE", "TTL LEFT"], rows)

    @app.command()
    def rm(
        sandboxes: list[str] = typer.Argument(..., help="Sandbox ids."),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Remove sandboxes (stops everything they run)."""
        from .render import print_json

        node = _node(state_dir)
        recs = [node.lookup(s) for s in sandboxes]  # all ids valid before anything is removed
        removed = [node.remove(r.id).id for r in recs]
        if json_out:
            print_json({"removed": removed})
        else:
            for sid in removed:
                typer.echo(sid)

    @app.command()
    def pause(
        sandbox: str = typer.Argument(...),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Freeze every process of a sandbox (cgroup freezer)."""
        _status(_node(state_dir).pause(sandbox), json_out)

    @app.command()
    def resume(
        sandbox: str = typer.Argument(...),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Thaw a paused sandbox."""
        _status(_node(state_dir).resume(sandbox), json_out)

    @app.command()
    def snapshot(
        sandbox: str = typer.Argument(...),
        as_: str = typer.Option(..., "--as", help="NAME@VERSION of the new image."),
        push: str = typer.Option(None, "--push", help="Also push the image to this store URL."),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir", help=STATE_HELP),
    ) -> None:
        """Turn a sandbox's changes into a new layer and an image stacking it."""
        from .render import print_json

        out = _node(state_dir).snapshot(sandbox, as_, push)
        if json_out:
            print_json(out)
        else:
            typer.echo(f"{out['image']} {out['image_digest'][:12]} "
                       f"(layer {out['layer']} {out['layer_digest'][:12]})")


def _status(rec: Any, json_out: bool) -> None:
    from .render import print_json

    if json_out:
        print_json(rec.public())
    else:
        typer.echo(f"{rec.id} {rec.status}")

