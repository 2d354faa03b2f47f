"""`dsec pool ls|set|fill|drain`: this node's warm pools of ready sandboxes. Thin: parse, call
dsec_cli.api.pools, render."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .render import human_bytes, print_json, table
from .sandbox import EnvOpt, JsonOpt, StateOpt, WorkdirOpt
from .sandbox_io import parse_env

pool_app = typer.Typer(help="Warm pools: sandboxes made ahead, taken by creates with the same "
                            "image, backend, limits and environment.", no_args_is_help=True)


def _render(pools: list[dict[str, Any]]) -> None:
    rows = []
    for p in pools:
        lim = p["limits"]
        limits = ", ".join(f"{k}={human_bytes(v) if k in ('memory', 'disk') else v}"
                           for k, v in lim.items() if v is not None) or "-"
        rows.append((p["key"][:12], p["image"], p["backend"], limits, str(p["size"]),
                     str(p["target"]), str(p["ready"]), str(p["creating"])))
    table(None, ("POOL", "IMAGE", "BACKEND", "LIMITS", "SIZE", "TARGET", "READY", "CREATING"),
          rows)


@pool_app.command("ls")
def ls(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """List the pools: their size (fixed or auto), current target, ready and creating members."""
    from ..api.pools import list_pools

    out = list_pools(state_dir)
    if json_out:
        print_json(out)
    else:
        _render(out["pools"])


@pool_app.command("set")
def set_(
    image: Annotated[str, typer.Argument(help="image (NAME@VERSION or digest) of the store")],
    size: Annotated[str, typer.Option("--size", help="members kept ready, or auto (learned "
                                                     "from recent creations)")] = "auto",
    backend: Annotated[str, typer.Option("--backend", "-b",
                                         help="container | fncall | microvm | vm")
                       ] = "container",
    cpus: Annotated[float | None, typer.Option(help="CPU share, as given to run")  # noqa: UP007
                    ] = None,
    memory: Annotated[str | None, typer.Option(help="memory limit, as given to run")  # noqa: UP007
                      ] = None,
    pids: Annotated[int | None, typer.Option(help="process limit, as given to run")  # noqa: UP007
                    ] = None,
    disk: Annotated[str | None, typer.Option(help="disk limit, as given to run")  # noqa: UP007
                    ] = None,
    network: Annotated[str, typer.Option(help="none | host, as given to run")] = "none",
    env: EnvOpt = None,
    workdir: WorkdirOpt = None,
    fill: Annotated[bool, typer.Option("--fill/--no-fill",
                                       help="make the members before returning")] = True,
    json_out: JsonOpt = False,
    state_dir: StateOpt = None,
) -> None:
    """Keep a pool for creates with exactly these options (size 0 keeps none)."""
    from ..api.pools import set_pool
    from ..core import validate

    validate.image(image)
    out = set_pool(image, size, backend, cpus=cpus, memory=memory, pids=pids, disk=disk,
                   network=network, env=parse_env(env), workdir=workdir, fill=fill,
                   state_dir=state_dir, prefix="--")
    if isinstance(out["size"], int) and out["size"] > out["budget_members"]:
        typer.echo(f"warning: the pool memory budget holds {out['budget_members']} of these "
                   f"members, not {out['size']} (raise config pool.memory)", err=True)
    if json_out:
        print_json(out)
    else:
        _render([out])


@pool_app.command("fill")
def fill(json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Make every member the pools lack now."""
    from ..api.pools import fill_pools

    n = fill_pools(state_dir)
    if json_out:
        print_json({"made": n})
    else:
        typer.echo(f"made {n} pool member(s)")


@pool_app.command("drain")
def drain(
    key: Annotated[str | None, typer.Argument(help="a pool (key prefix, as `dsec pool ls` "
                                                   "shows); default: every pool")] = None,
    json_out: JsonOpt = False,
    state_dir: StateOpt = None,
) -> None:
    """Stop keeping pools and remove their ready members."""
    from ..api.pools import drain_pools

    removed = drain_pools(key, state_dir)
    if json_out:
        print_json({"removed": removed})
    else:
        typer.echo(f"removed {len(removed)} pool member(s)")


def register(app: typer.Typer) -> None:
    app.add_typer(pool_app, name="pool")
