"""`dsec gc`: garbage-collect a store (this module) or nodes (`--node`, the run stage)."""

from __future__ import annotations

import typer

from .render import human_bytes, print_json


def register(app: typer.Typer) -> None:
    @app.command()
    def gc(
        store: str | None = typer.Option(None, "--store", help="store URL (default: local)"),
        grace: str = typer.Option("1h", "--grace",
                                  help="how long garbage must stay unreachable before it goes"),
        dry_run: bool = typer.Option(False, "--dry-run", help="show what would go; change nothing"),
        endpoint_url: str | None = typer.Option(None, "--endpoint-url", help="S3 endpoint"),
        insecure: bool = typer.Option(False, "--insecure", help="plain HTTP for oci://"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    ) -> None:
        """Delete store objects no ref or pin reaches, safely while others push."""
        from ..core.config import parse_duration
        from ..push.api import _options
        from ..push.gc import gc_store
        from ..push.retry import open_retrying

        seconds = parse_duration(grace, "--grace")
        with open_retrying(store, **_options(endpoint_url, insecure)) as s:
            report = gc_store(s, grace=seconds, dry_run=dry_run)
        if as_json:
            print_json(report.to_dict())
            return
        typer.echo(f"{report.store}: {report.refs} refs, {report.pins} pins reach "
                   f"{report.reachable} objects ({human_bytes(report.reachable_bytes)}): kept")
        if dry_run:
            typer.echo(f"would delete {len(report.would_delete)} objects "
                       f"({human_bytes(report.freed_bytes)})")
        else:
            typer.echo(f"deleted {len(report.deleted)} objects "
                       f"({human_bytes(report.freed_bytes)}) unreachable for over {grace}")
        typer.echo(f"unreachable: {report.unreachable} ({len(report.marked)} newly marked, "
                   f"{report.waiting} waiting out the grace period, {report.recent} too recent "
                   f"to mark); {report.resurrected} candidates reachable again")
        if report.repack_candidates:
            typer.echo(f"{len(report.repack_candidates)} live packs are mostly dead "
                       f"({human_bytes(report.dead_bytes_in_live_packs)} dead in live packs); "
                       "repacking is not performed")
        if report.leases_live:
            typer.echo(f"{report.leases_live} writer lease(s) live")
        for d in report.dangling:
            typer.echo(f"dangling: {d}", err=True)
        if report.deferred:
            typer.echo(f"deferred: {report.deferred}")
