"""Commands of the build stage: build, ls, inspect, export."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def version() -> None:
        """Print the dsec version."""
        from importlib.metadata import version as v

        typer.echo(v("dsec"))
