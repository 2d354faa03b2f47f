"""`dsec import`: OCI and Docker images (registry, OCI layout, docker save) into a store."""

from __future__ import annotations

import typer

from .render import human_bytes, print_json
from .store import INSECURE, JSON, STORE, _run


def register(app: typer.Typer) -> None:
    @app.command("import")
    def import_(
        source: str = typer.Argument(..., help="host/repo:tag or host/repo@sha256:..., an OCI "
                                     "layout directory, or a docker save tarball (each "
                                     "optionally :TAG)", show_default=False),
        as_ref: str | None = typer.Option(None, "--as", help="NAME@VERSION of the image "
                                          "(default: the repository's name and tag)"),
        platform: str | None = typer.Option(None, "--platform", help="OS/ARCH or "
                                            "OS/ARCH/VARIANT to pick from an image index "
                                            "(default: this host)"),
        store: str | None = STORE, insecure: bool = INSECURE,
        replace: bool = typer.Option(False, "--replace", help="move a NAME@VERSION the store "
                                     "holds with other content"),
        as_json: bool = JSON,
    ) -> None:
        """Import an OCI or Docker image: each layer becomes a dsec layer, the config an image."""
        from ..api import oci

        report = _run("import", as_json, oci.import_image, source=source, as_ref=as_ref,
                      store=store, platform=platform, insecure=insecure, replace=replace)
        if as_json:
            print_json(report.to_dict())
            return
        for layer in report.layers:
            state = "present" if layer.reused else f"{human_bytes(layer.new_bytes)} new"
            typer.echo(f"  {layer.diff_id[7:19]} -> {layer.manifest[:12]} "
                       f"{human_bytes(layer.size)} ({state})")
        rate = report.bytes_read / report.seconds if report.seconds else 0
        typer.echo(f"imported {report.ref} ({report.manifest[:12]}) from "
                   f"{report.source_digest[:19] or report.source}: {len(report.layers)} layers, "
                   f"{human_bytes(report.bytes_read)} read in {report.seconds:.1f}s "
                   f"({human_bytes(rate)}/s)")
