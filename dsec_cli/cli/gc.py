"""`dsec gc`: garbage-collect a store (default) and/or this node's sandboxes and cache
(`--node`)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer

from ..core.errors import UsageError
from .render import human_bytes, print_json


def register(app: typer.Typer) -> None:
    @app.command()
    def gc(
        store: Annotated[str | None, typer.Option("--store", help="store URL (default: local)")
                         ] = None,
        node: Annotated[bool, typer.Option(
            "--node", help="collect this node's expired/dead sandboxes and cached layers")] = False,
        grace: Annotated[str, typer.Option(
            "--grace", help="how long garbage must stay unreachable before it goes")] = "1h",
        budget: Annotated[str | None, typer.Option(
            "--budget", help="layer cache budget with --node, e.g. 20G")] = None,
        repack_threshold: Annotated[float, typer.Option(
            "--repack-threshold", min=0.0, max=1.0,
            help="repack live packs whose dead fraction is above this (1 = never)")] = 0.5,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="show what would go")] = False,
        endpoint_url: Annotated[str | None, typer.Option(
            "--endpoint-url", help="S3 endpoint")] = None,
        insecure: Annotated[bool, typer.Option("--insecure", help="plain HTTP for oci://")
                            ] = False,
        state_dir: Annotated[str | None, typer.Option(
            "--state-dir", help="node state directory (default: DSEC_STATE_DIR)")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
        all_nodes: Annotated[bool, typer.Option(
            "--all-nodes", help="collect every cluster node (in parallel; as --node there)")
                             ] = False,
    ) -> None:
        """Delete what nothing references: store objects no ref or pin reaches (safe while
        others push), and with --node this node's expired sandboxes and least recently used
        layers."""
        if not math.isfinite(repack_threshold):
            raise UsageError(f"invalid --repack-threshold {repack_threshold}: expected a "
                             "number from 0 to 1")
        from ..core import validate

        cache_budget = None if budget is None else validate.size(budget, "--budget")
        out: dict[str, Any] = {}
        if all_nodes:
            from ..api.cluster import gc_nodes

            results = [r.to_dict() for r in gc_nodes(cache_budget, dry_run)]
            failed = [r for r in results if not r["ok"]]
            if as_json:
                print_json({"nodes": results})
            else:
                for r in results:
                    if r["ok"]:
                        typer.echo(f"== {r['node']}")
                        _render_node(r["result"], dry_run)
            from .node import render_fanout

            render_fanout(failed)
            if store is None:
                return
        if node:
            from ..api.sandboxes import gc_node

            out["node"] = gc_node(cache_budget, dry_run, state_dir)
        if store is not None or not node:
            from ..api.store import gc as gc_store

            out["store"] = gc_store(store, grace=grace, dry_run=dry_run,
                                    repack_threshold=repack_threshold,
                                    endpoint_url=endpoint_url, insecure=insecure)
        if as_json:
            print_json({k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in out.items()})
        else:
            if "node" in out:
                _render_node(out["node"], dry_run)
            if "store" in out:
                _render_store(out["store"], dry_run, grace)
        st = out.get("store")
        if st is not None and (st.dangling or st.unreadable):
            raise typer.Exit(1)  # gc kept what it could not read: cron should notice


def _render_node(report: dict[str, Any], dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    for r in report["removed"]:
        typer.echo(f"{verb} sandbox {r['id']} ({r['reason']})")
    for sid in report.get("aborted", []):
        typer.echo(f"cleaned up interrupted create {sid}")
    for sid in report.get("orphans", []):
        typer.echo(f"cleaned up orphaned resources of {sid}")
    for sid in report.get("pool_reclaimed", []):
        typer.echo(f"{verb} warm pool member {sid}")
    for key in report.get("vm_boots_pruned", []):
        typer.echo(f"{verb} saved VM boot {key}")
    for d in report["evicted"]:
        typer.echo(f"{'would evict' if dry_run else 'evicted'} layer {d[:12]}")
    for d in report.get("stale_builds", []):
        typer.echo(f"{verb} the staging dir of a build that died: {d}")
    typer.echo(f"node: freed {human_bytes(report['freed_bytes'])}; "
               f"cache now {human_bytes(report['cache_bytes'])}")


def _render_store(report: Any, dry_run: bool, grace: str) -> None:
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
    if report.repack_candidates and not report.repacked:
        typer.echo(f"{len(report.repack_candidates)} live packs are mostly dead "
                   f"({human_bytes(report.dead_bytes_in_live_packs)} dead in live packs)"
                   + ("; would repack them" if dry_run else ""))
    if report.repacked:
        r = report.repacked
        typer.echo(f"repacked {len(r['packs_rewritten'])} packs into {len(r['packs_written'])} "
                   f"({human_bytes(r['bytes_copied'])} copied); moved {len(r['refs_moved'])} refs"
                   + (f", skipped {len(r['refs_skipped'])} moved meanwhile"
                      if r["refs_skipped"] else ""))
    if report.leases_live:
        typer.echo(f"{report.leases_live} writer lease(s) live")
    for d in report.dangling:
        typer.echo(f"dangling: {d}", err=True)
    for d in report.unreadable:
        typer.echo(f"unreadable: {d}", err=True)
    if report.deferred:
        typer.echo(f"deferred: {report.deferred}")
