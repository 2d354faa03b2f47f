"""`dsec optimize IMAGE [-- CMD]`: write the files sandboxes read at start into new versions of
an image's layers as prefetch lists (thin: parse, call dsec_cli.api.images, render)."""

from __future__ import annotations

from typing import Annotated, Any

import typer


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"ignore_unknown_options": True})
    def optimize(
        image: Annotated[str, typer.Argument(help="image or layer (NAME@VERSION or digest)")],
        cmd: Annotated[list[str] | None, typer.Argument(  # noqa: UP007
            help="workload to profile first, in a lazy sandbox (after --)")] = None,
        as_: Annotated[str | None, typer.Option(  # noqa: UP007
            "--as", help="NAME@VERSION of the new image (default: VERSION-opt)")] = None,
        backend: Annotated[str, typer.Option("--backend", "-b")] = "container",
        timeout: Annotated[float | None, typer.Option(  # noqa: UP007
            help="kill the profiled command after this many seconds")] = None,
        store: Annotated[str | None, typer.Option("--store", help="store URL")  # noqa: UP007
                         ] = None,
        state_dir: Annotated[str | None, typer.Option(  # noqa: UP007
            "--state-dir", help="node state directory (default: DSEC_STATE_DIR)")] = None,
        json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    ) -> None:
        """Profiled prefetch: record what IMAGE reads at start (from earlier `dsec run --fetch
        lazy` runs, or by running CMD now) and publish layer versions that prefetch it."""
        from ..api.images import optimize_image
        from .render import print_json

        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        res: Any = optimize_image(image, cmd or None, as_ref=as_, backend=backend,
                                  timeout=timeout, store=store, state_dir=state_dir)
        if json_out:
            print_json(res.public())
            return
        for layer in res.layers:
            typer.echo(f"{layer['layer']} {layer['digest'][:12]} "
                       f"prefetch {layer['prefetch']} files")
        typer.echo(f"{res.image} {res.image_digest[:12]}")
