"""`dsec gc --node`: expired and dead sandboxes, then cached layers over the disk budget."""

from __future__ import annotations

from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def gc(
        node: Annotated[bool, typer.Option("--node",
                                           help="collect this node's sandboxes and cache")
                        ] = False,
        budget: Annotated[str | None,  # noqa: UP007
                          typer.Option("--budget",
                                       help="layer cache budget, e.g. 20G (default: cache_budget)")
                          ] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="show what would go")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
        state_dir: Annotated[str | None,  # noqa: UP007
                             typer.Option("--state-dir",
                                          help="node state directory (default: DSEC_STATE_DIR)")
                             ] = None,
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
