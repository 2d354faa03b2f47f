"""`dsec import`: OCI and Docker images (registry, OCI layout, docker save) into a store."""

from __future__ import annotations

from typing import Any

import typer

from ..core.errors import UsageError
from .render import human_bytes, print_json
from .store import INSECURE, JSON, STORE, _run

SOURCES = typer.Argument(..., help="host/repo:tag or host/repo@sha256:..., an OCI layout "
                         "directory, or a docker save tarball (each optionally :TAG); several "
                         "are imported in one run", show_default=False)


def _summary(report: Any) -> str:
    rate = report.bytes_read / report.seconds if report.seconds else 0
    return (f"imported {report.ref} ({report.manifest[:12]}) from "
            f"{report.source_digest[:19] or report.source}: {len(report.layers)} layers, "
            f"{human_bytes(report.bytes_read)} read in {report.seconds:.1f}s "
            f"({human_bytes(rate)}/s)")


def register(app: typer.Typer) -> None:
    @app.command("import")
    def import_(
        sources: list[str] = SOURCES,
        as_ref: str | None = typer.Option(None, "--as", help="NAME@VERSION of the image "
                                          "(one source only; default: the repository's name "
                                          "and tag)"),
        platform: str | None = typer.Option(None, "--platform", help="OS/ARCH or "
                                            "OS/ARCH/VARIANT to pick from an image index "
                                            "(default: this host)"),
        store: str | None = STORE, insecure: bool = INSECURE,
        replace: bool = typer.Option(False, "--replace", help="move a NAME@VERSION the store "
                                     "holds with other content"),
        as_json: bool = JSON,
    ) -> None:
        """Import OCI or Docker images: each layer becomes a dsec layer, each config an image.
        Several sources are read in one run (a layer they share read once); one that fails
        is reported and the others are imported."""
        from ..api import oci

        if as_ref is not None and len(sources) > 1:
            raise UsageError("--as names one image: import several sources under the names "
                             "their references give")
        if len(sources) == 1:
            report = _run("import", as_json, oci.import_image, source=sources[0],
                          as_ref=as_ref, store=store, platform=platform, insecure=insecure,
                          replace=replace)
            if as_json:
                print_json(report.to_dict())
                return
            for layer in report.layers:
                state = "present" if layer.reused else f"{human_bytes(layer.new_bytes)} new"
                typer.echo(f"  {layer.diff_id[7:19]} -> {layer.manifest[:12]} "
                           f"{human_bytes(layer.size)} ({state})")
            typer.echo(_summary(report))
            return
        run = _run("import", as_json, oci.import_images, sources=sources, store=store,
                   platform=platform, insecure=insecure, replace=replace)
        if as_json:
            print_json(run.to_dict())
        else:
            for report in run.reports:
                typer.echo(_summary(report))
            read = sum(r.bytes_read for r in run.reports)
            typer.echo(f"{len(run.reports)} of {len(sources)} images imported, "
                       f"{human_bytes(read)} read in {run.seconds:.1f}s")
        if run.failed:
            from .render import print_error

            for _, e in run.failed[1:]:
                print_error(e)
            raise run.failed[0][1]  # printed last, its exit code the command's
