"""`dsec gc --node`: expired and dead sandboxes, then cached layers over the disk budget."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def gc(
        node: bool = typer.Option(False, "--node", help="Collect this node's sandboxes and cache."),
        budget: str = typer.Option(None, "--budget",
                                   help="Layer cache budget, e.g. 20G (default: cache_budget)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Show what would go."),
        json_out: bool = typer.Option(False, "--json"),
        state_dir: str = typer.Option(None, "--state-dir",
                                      help="Node state directory (default: DSEC_STATE_DIR)."),
    ) -> None:
        """Garbage-collect: with --node, expired/dead sandboxes and least recently used layers."""
        from ..core.config import parse_size
        from ..core.errors import UsageError
        from ..run.node import local_node
        from .render import human_bytes, print_json

        if not node:
            raise UsageError("say what to collect: --node (this node's sandboxes and cache)")
        report = local_node(state_dir).gc(parse_size(budget, "--budget") if budget else None,
                                          dry_run)
        if json_out:
            print_json(report)
            return
        verb = "would remove" if dry_run else "removed"
        for r in report["removed"]:
            typer.echo(f"{verb} sandbox {r['id']} ({r['reason']})")
        for sid in report.get("aborted", []):
            typer.echo(f"cleaned up interrupted create {sid}")
        for sid in report.get("orphans", []):
            typer.echo(f"cleaned up orphaned resources of {sid}")
        for d in report["evicted"]:
            typer.echo(f"{'would evict' if dry_run else 'evicted'} layer {d[:12]}")
        typer.echo(f"freed {human_bytes(report['freed_bytes'])}; "
                   f"cache now {human_bytes(report['cache_bytes'])}")
