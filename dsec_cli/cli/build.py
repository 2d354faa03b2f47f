"""Commands of the build stage: build, ls, inspect, export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import __version__
from ..core.errors import UsageError
from .render import console, human_bytes, print_json, table
from .text import terminal_safe

StoreOpt = Annotated[str | None, typer.Option("--store", help="store URL (default: embedded)")]  # noqa: UP007
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def register(app: typer.Typer) -> None:
    @app.command()
    def build(
        specs: Annotated[list[Path] | None, typer.Argument(help="spec files or folders")] = None,  # noqa: UP007
        store: StoreOpt = None,
        force: Annotated[bool, typer.Option("--force", help="rebuild even if cached")] = False,
        replace: Annotated[bool, typer.Option(
            "--replace", help="move a NAME@VERSION the store holds with other content "
            "(versions are immutable otherwise)")] = False,
        chunk_sha256: Annotated[bool, typer.Option(
            "--chunk-sha256", help="also store a sha256 per chunk (stores shared across trust "
            "domains)")] = False,
        as_ref: Annotated[str | None, typer.Option(  # noqa: UP007
            "--as", help="build a Dockerfile into this NAME@VERSION image")] = None,
        build_arg: Annotated[list[str] | None, typer.Option(  # noqa: UP007
            "--build-arg", help="a Dockerfile ARG, KEY=VALUE (repeatable)")] = None,
        target: Annotated[str, typer.Option("--target", help="the Dockerfile stage to build")
                          ] = "",
        squash: Annotated[bool, typer.Option(
            "--squash", help="one layer for all of the Dockerfile stage's changes")] = False,
        json_: JsonOpt = False,
    ) -> None:
        """Build layer and image specs (default: layerspecs/), or a Dockerfile with --as,
        into a store."""
        from .build_io import build_command, dockerfile_options

        build_command(specs or None, store, force=force, replace=replace,
                      chunk_sha256=chunk_sha256, json_out=json_,
                      dockerfile=dockerfile_options(specs, as_ref, build_arg, target, squash))

    @app.command("ls")
    def ls(
        what: Annotated[str, typer.Argument(help="layers, images or all")] = "all",
        store: StoreOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """List layers and images in a store."""
        from ..api import images

        items = images.list_images(what, store)
        if json_:
            print_json([i.__dict__ for i in items])
            return
        table(None, ["ref", "kind", "digest", "files", "size", "stored"],
              [(i.ref, i.kind, i.digest[:12], i.files, human_bytes(i.size),
                human_bytes(i.stored_size)) for i in items if not i.error])

        for i in items:
            if i.error:  # the error quotes a store object: shown as text
                typer.echo(terminal_safe(f"broken: {i.ref}: {i.error}"), err=True)

    @app.command()
    def inspect(
        ref: Annotated[str, typer.Argument(help="NAME@VERSION, a manifest digest, or a "
                                           "sandbox id")],
        store: StoreOpt = None,
        files: Annotated[bool, typer.Option("--files", help="list the layer's files")] = False,
        json_: JsonOpt = False,
    ) -> None:
        """Show a layer's or image's manifest and index, or a sandbox's state."""
        from ..api import images

        doc = images.inspect(ref, store, files=files)
        if json_:
            print_json(doc)
            return
        console().print_json(data=doc, default=str)

    @app.command()
    def export(
        ref: Annotated[str, typer.Argument(help="NAME@VERSION of a layer or image")],
        dest: Annotated[Path | None, typer.Argument(  # noqa: UP007
            help="a new directory, or a file ending in .tar")] = None,
        store: StoreOpt = None,
        format_: Annotated[str, typer.Option(
            "--format", help="tree: the merged files; oci: an OCI image layout")] = "tree",
        to_registry: Annotated[str | None, typer.Option(  # noqa: UP007
            "--to-registry", help="push as an OCI image to HOST/REPO:TAG")] = None,
        compression: Annotated[str, typer.Option(
            "--compression", help="OCI layer compression: gzip or zstd")] = "gzip",
        insecure: Annotated[bool, typer.Option(
            "--insecure", help="plain HTTP for --to-registry")] = False,
        json_: JsonOpt = False,
    ) -> None:
        """Write an image's merged tree (whiteouts applied) to a directory or a tar, or the
        image as a runnable OCI image (--format oci, --to-registry)."""
        if format_ not in ("tree", "oci"):
            raise UsageError(f"unknown export format {format_!r}: choose tree or oci")
        if format_ == "oci" or to_registry:
            from ..api import oci
            from .store import _run

            report = _run("export", json_, oci.export_oci, ref=ref, dest=dest,
                          to_registry=to_registry, store=store, compression=compression,
                          insecure=insecure)
            if json_:
                print_json(report.to_dict())
            else:
                where = " and ".join(x for x in (report.dest, report.registry) if x)
                console().print(f"exported {ref} ({report.digest[:12]}) as OCI image "
                                f"{report.manifest_digest[:19]} to {where}: "
                                f"{len(report.layers)} layers, "
                                f"{human_bytes(report.bytes_written)}", highlight=False)
            return
        if dest is None:
            raise UsageError("export needs a destination (a directory or a .tar file)")
        from ..api import images

        img = images.export_image(ref, dest, store)
        if json_:
            print_json({"ref": ref, "digest": img.digest, "dest": str(dest)})
        else:
            console().print(f"exported {ref} ({img.digest[:12]}) to {dest}")

    @app.command()
    def version() -> None:
        """Print the dsec version."""
        typer.echo(__version__)
