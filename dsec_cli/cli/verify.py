"""`dsec verify`: check a store's refs, manifests, indexes and packs (thin: parse, call
dsec_cli.api.store, render). Exits 0 when every object is sound, 1 when any is bad."""

from __future__ import annotations

from typing import Annotated

import typer

from .render import human_bytes, print_json


def register(app: typer.Typer) -> None:
    @app.command()
    def verify(
        refs: Annotated[list[str] | None, typer.Argument(
            help="NAME@VERSION or manifest digests to check (default: every ref)",
            show_default=False)] = None,
        deep: Annotated[bool, typer.Option(
            "--deep", help="read every pack and re-hash every chunk")] = False,
        store: Annotated[str | None, typer.Option("--store", help="store URL (default: local)")
                         ] = None,
        endpoint_url: Annotated[str | None, typer.Option(
            "--endpoint-url", help="S3 endpoint")] = None,
        insecure: Annotated[bool, typer.Option("--insecure", help="plain HTTP for oci://")
                            ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    ) -> None:
        """Check the objects reachable from refs: one line per bad object, then counts.
        Exit 0 when all is well, 1 when any object is bad (for cron)."""
        from ..api.store import verify_store

        report = verify_store(refs or [], store=store, deep=deep, endpoint_url=endpoint_url,
                              insecure=insecure)
        if as_json:
            print_json(report.to_dict())
        else:
            for p in report.problems:
                typer.echo(f"bad {p}")
            chunks = (f", {report.chunks} chunks ({human_bytes(report.bytes_read)} read)"
                      if deep else "")
            typer.echo(f"{report.store}: checked {report.refs} refs, {report.manifests} "
                       f"manifests, {report.indexes} indexes, {report.packs} packs{chunks}: "
                       f"{len(report.problems)} problem(s)")
        if not report.ok:
            raise typer.Exit(1)
