"""Density commands: `dsec park`, `dsec thaw`, `dsec top`, `dsec node setup` (thin: parse,
call dsec_cli.api, render). docs/density.md."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from .render import console, human_bytes, print_json
from .sandbox import JsonOpt, NodeOpt, SandboxArg, StateOpt


def _mem_line(doc: dict[str, Any]) -> str:
    return (f"{doc['id']} {doc.get('status', '')}: resident "
            f"{human_bytes(doc.get('resident', 0))}, reclaimed "
            f"{human_bytes(doc.get('reclaimed', 0))}, swapped {human_bytes(doc.get('swapped', 0))}"
            + (f", state file {human_bytes(doc['state_bytes'])}" if doc.get("state_bytes") else ""))


def _rows(docs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    rows = []
    for d in docs:
        cpu = d.get("cpu")
        declared = d.get("declared_memory")
        rows.append((d["id"], d.get("backend", ""), d.get("class", ""), d.get("status", ""),
                     "" if cpu is None else f"{cpu * 100:.0f}%",
                     human_bytes(d.get("resident", 0)),
                     "" if declared is None else human_bytes(declared),
                     human_bytes(d.get("reclaimed", 0)), human_bytes(d.get("swapped", 0)),
                     f"{d.get('idle_seconds', 0):.0f}s"))
    return rows


COLUMNS = ["ID", "BACKEND", "CLASS", "STATUS", "CPU", "RESIDENT", "DECLARED", "RECLAIMED",
           "SWAPPED", "IDLE"]


def _top_table(docs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title=f"dsec top  {time.strftime('%H:%M:%S')}", show_edge=False,
              header_style="bold")
    for c in COLUMNS:
        t.add_column(c)
    for r in _rows(docs):
        t.add_row(*(str(v) for v in r))
    return t


def register(app: typer.Typer) -> None:
    @app.command()
    def park(sandbox: SandboxArg, json_out: JsonOpt = False, state_dir: StateOpt = None,
             node: NodeOpt = None) -> None:
        """Stop a sandbox and give its memory back (to swap where the node has swap)."""
        from ..api.sandboxes import park as park_sandbox

        out = park_sandbox(sandbox, node, state_dir)
        if json_out:
            print_json(out)
        else:
            typer.echo(_mem_line(out))

    @app.command()
    def thaw(sandbox: SandboxArg, json_out: JsonOpt = False, state_dir: StateOpt = None,
             node: NodeOpt = None,
             prefetch: Annotated[bool, typer.Option(
                 "--prefetch", help="also read its memory back from swap now, ahead of "
                 "need (a running sandbox's too)")] = False,
             to: Annotated[str | None, typer.Option(  # noqa: UP007
                 "--to", help="move a parked VM to this cluster node (or local) and thaw it "
                              "there, keeping its id")] = None) -> None:
        """Let a parked sandbox run again: the same files and processes."""
        from ..api.sandboxes import thaw as thaw_sandbox

        out = thaw_sandbox(sandbox, node, state_dir, prefetch, to)
        if json_out:
            print_json(out)
        else:
            if to is not None:
                typer.echo(f"moved to {out['id']}")
            typer.echo(_mem_line(out))

    @app.command()
    def top(
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
        node: NodeOpt = None,
        interval: Annotated[float, typer.Option(
            "--interval", help="seconds between refreshes (and CPU samples)")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="print one table and exit")] = False,
    ) -> None:
        """Per sandbox: CPU, resident, declared, reclaimed and swapped memory, class, idle
        time; refreshed live on a terminal, one sample with --json or --once."""
        from rich.live import Live

        from ..api.sandboxes import top as top_sandboxes
        from ..core import validate

        validate.positive_float(interval, "--interval")
        if json_out or once or not console().is_terminal:
            docs = top_sandboxes(state_dir, node, min(interval, 60))
            if json_out:
                print_json(docs)
            else:
                console().print(_top_table(docs))
            return
        with Live(console=console(), auto_refresh=False) as live:
            try:
                while True:
                    live.update(_top_table(top_sandboxes(state_dir, node, min(interval, 60))),
                                refresh=True)
            except KeyboardInterrupt:
                pass
