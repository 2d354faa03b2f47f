"""Commands that move layers between stores: push, pull, rmi."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from .render import human_bytes, print_json, progress

REFS = typer.Argument(..., help="NAME@VERSION of layers or images", show_default=False)
ENDPOINT = typer.Option(None, "--endpoint-url",
                        help="S3 endpoint for s3:// URLs (default: $AWS_ENDPOINT_URL or AWS)")
INSECURE = typer.Option(False, "--insecure", help="plain HTTP for an oci:// registry")
STORE = typer.Option(None, "--store", help="the local store (default: the configured one)")
JOBS = typer.Option(8, "--jobs", "-j", min=1, max=64, help="objects in flight at once")
JSON = typer.Option(False, "--json", help="machine-readable output")
REPLACE = typer.Option(False, "--replace", help="move a NAME@VERSION the destination holds "
                       "with other content (versions are immutable otherwise)")


def _run(verb: str, as_json: bool, fn: Callable[..., Any], **kw: Any) -> Any:
    with progress(not as_json) as bar:
        if bar is None:
            return fn(**kw)
        task = bar.add_task(f"{verb}: checking", total=None)

        def update(p: Any) -> None:
            bar.update(task, completed=p.bytes_done, total=p.bytes_total or None,
                       description=f"{verb}: {p.objects_done}/{p.objects_total} objects")

        return fn(progress=update, **kw)


def _render(verb: str, report: Any, as_json: bool) -> None:
    if as_json:
        print_json(report.to_dict())
        return
    rate = report.bytes_sent / report.seconds if report.seconds else 0
    for r in report.refs:
        typer.echo(f"{verb} {r.ref} ({r.manifest[:12]}): {r.sent} of {r.objects} objects sent"
                   + (f"; replaced {r.replaced[:12]}" if r.replaced else ""))
    typer.echo(f"{report.objects_sent} objects, {human_bytes(report.bytes_sent)} in "
               f"{report.seconds:.1f}s ({human_bytes(rate)}/s); "
               f"{report.objects_present} already in {report.destination}")


def register(app: typer.Typer) -> None:
    @app.command()
    def push(refs: list[str] = REFS,
             to: str = typer.Option(..., "--to", help="destination store URL",
                                    show_default=False),
             store: str | None = STORE, endpoint_url: str | None = ENDPOINT,
             insecure: bool = INSECURE, jobs: int = JOBS, replace: bool = REPLACE,
             as_json: bool = JSON) -> None:
        """Copy layers or images (with their layers) to a store; sends only what it lacks."""
        from ..api import store as api

        report = _run("push", as_json, api.push, refs=refs, to=to, store=store, jobs=jobs,
                      endpoint_url=endpoint_url, insecure=insecure, replace=replace)
        _render("pushed", report, as_json)

    @app.command()
    def pull(refs: list[str] = REFS,
             frm: str = typer.Option(..., "--from", help="source store URL", show_default=False),
             store: str | None = STORE, endpoint_url: str | None = ENDPOINT,
             insecure: bool = INSECURE, jobs: int = JOBS, replace: bool = REPLACE,
             as_json: bool = JSON) -> None:
        """Copy layers or images from a store into the local one; verifies everything read."""
        from ..api import store as api

        report = _run("pull", as_json, api.pull, refs=refs, frm=frm, store=store, jobs=jobs,
                      endpoint_url=endpoint_url, insecure=insecure, replace=replace)
        _render("pulled", report, as_json)

    @app.command()
    def rmi(refs: list[str] = REFS,
            store: str | None = typer.Option(None, "--store", help="store URL (default: local)"),
            endpoint_url: str | None = ENDPOINT, insecure: bool = INSECURE,
            as_json: bool = JSON) -> None:
        """Remove layer or image refs; `dsec gc` frees what only they reached."""
        from ..api import images

        removed = images.rmi(refs, store=store, endpoint_url=endpoint_url, insecure=insecure)
        if as_json:
            print_json([{"ref": r.ref, "manifest": r.manifest} for r in removed])
        else:
            for r in removed:
                typer.echo(f"removed {r.ref} ({r.manifest[:12]})")
