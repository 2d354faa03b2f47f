"""`dsec node add|ls|check|rm` (the cluster's nodes, kept in the user's config) and
`dsec agent` (the node side the CLI reaches over SSH). Thin: parse, call
dsec_cli.api.cluster, render."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from .render import human_bytes, print_json, table

node_app = typer.Typer(help="Cluster nodes reached over SSH (each runs `dsec agent`).",
                       no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


@node_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="a short name, used in sandbox ids (NAME/ID)")],
    address: Annotated[str, typer.Argument(help="USER@HOST[:PORT]")],
    identity: Annotated[str | None, typer.Option(  # noqa: UP007
        "--identity", "-i", help="private key file (default: ssh's own choice)")] = None,
    known_hosts: Annotated[str | None, typer.Option(  # noqa: UP007
        "--known-hosts", help="known_hosts file to check the host key against "
                              "(default ~/.ssh/known_hosts)")] = None,
    labels: Annotated[str | None, typer.Option(  # noqa: UP007
        "--labels", help="k=v,k=v")] = None,
    dsec: Annotated[str, typer.Option("--dsec", help="the dsec command on the node")] = "dsec",
    bootstrap: Annotated[bool, typer.Option(
        "--bootstrap", help="install this dsec on the node first (nothing from the network)")
                         ] = False,
    install_dir: Annotated[str | None, typer.Option(  # noqa: UP007
        "--install-dir", help="where --bootstrap installs on the node "
                              "(default ~/.local/share/dsec/bootstrap/VERSION)")] = None,
    check: Annotated[bool, typer.Option("--check/--no-check",
                                        help="reach the node before saving it")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Add a node: checks its host key and its node service, then saves it in the user config."""
    from ..api.cluster import add_node

    out = add_node(name, address, identity=identity, known_hosts=known_hosts, labels=labels,
                   dsec=dsec, bootstrap=bootstrap, check=check, install_dir=install_dir)
    if json_out:
        print_json(out)
    else:
        v = out["info"].get("dsec", "not checked")
        typer.echo(f"added {name} ({out['address']}, dsec {v})")


def _rows(results: list[Any]) -> list[tuple[Any, ...]]:
    rows = []
    for r in results:
        if not r.ok:
            state = "unreachable" if r.to_dict()["unreachable"] else "error"
            rows.append((r.node, state, "", "", "", "", "", "", str(r.error)))
            continue
        i = r.value
        cap, use = i["capacity"], i["usage"]
        f = i.get("fetch") or {}
        fetch = f"{f['auto']} (lazy reads: {f['lazy']})" if f else ""
        rows.append((r.node, "ok", i["dsec"], f"{cap['cpus']:g} cpu, {human_bytes(cap['memory'])}",
                     f"{use['sandboxes']}/{cap['sandboxes']}", _use(cap, use),
                     human_bytes(i["cache_bytes"]), fetch, i.get("hostname", "")))
    return rows


def _use(cap: dict[str, Any], use: dict[str, Any]) -> str:
    """Declared CPUs and memory against the overcommitted capacity, and resident memory."""
    cpus = cap["cpus"] * cap.get("cpu_overcommit", 1)
    mem = cap["memory"] * cap.get("memory_overcommit", 1)
    return (f"{use['cpus']:g}/{cpus:g} cpu, {human_bytes(use['memory'])}/{human_bytes(mem)}, "
            f"{human_bytes(use.get('resident', 0))}")


def _status(names: list[str] | None, json_out: bool, timeout: float | None) -> None:
    from ..api.cluster import list_nodes

    results = list_nodes(timeout, names)
    if json_out:
        print_json([r.to_dict() for r in results])
    else:
        table(None, ["NODE", "STATE", "VERSION", "CAPACITY", "SANDBOXES",
                     "CPU / MEMORY DECLARED, RESIDENT", "CACHED", "FETCH AUTO", "HOST / ERROR"],
              _rows(results))
    if names and any(not r.ok for r in results):
        raise typer.Exit(1)


TimeoutOpt = Annotated[float | None, typer.Option(  # noqa: UP007
    "--timeout", help="seconds to wait for each node (default DSEC_NODE_TIMEOUT or 15)")]


@node_app.command("ls")
def ls(json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """List nodes: reachable, version, capacity, sandboxes, cached bytes (asked in parallel)."""
    _status(None, json_out, timeout)


@node_app.command("check")
def check_(
    names: Annotated[list[str] | None, typer.Argument(help="nodes (default: all)")  # noqa: UP007
                     ] = None,
    json_out: JsonOpt = False,
    timeout: TimeoutOpt = None,
    host: Annotated[bool, typer.Option(
        "--host", help="report this host's facilities instead: swap, KSM, cgroup v1/v2 "
                       "controllers, the compiled modules and agent, and the fallback for "
                       "each one missing")] = False,
) -> None:
    """Reach nodes over SSH and ask their node services; exits 1 if any does not answer."""
    if host:
        from ..api.density import host_facts
        from ..core.compiled import compiled_status

        _host({**host_facts(), "compiled": compiled_status()}, json_out)
        return
    from ..api.cluster import load_nodes

    _status(names or list(load_nodes()) or None, json_out, timeout)


def _host(facts: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print_json(facts)
        return
    ctl = ", ".join(f"{c} {v or 'missing'}" for c, v in facts["cgroup_controllers"].items())
    ksm = facts["ksm"]
    typer.echo(f"cgroups:  {ctl}")
    typer.echo(f"reclaim:  {facts['reclaim'] or 'none'}; cpu.idle "
               f"{'yes' if facts['cpu_idle'] else 'no'}; per-task slices "
               f"{'yes' if facts.get('custom_slices') else 'no'}")
    typer.echo(f"swap:     {human_bytes(facts['swap_total'])} "
               f"({human_bytes(facts['swap_free'])} free)")
    typer.echo("ksm:      " + ("not in this kernel" if not ksm["available"] else
                               f"{'on' if ksm.get('run') else 'off'}, saving "
                               f"{human_bytes(ksm.get('saved_bytes', 0))}"))
    for backend, how in facts.get("park", {}).items():
        typer.echo(f"park {backend + ':':11s}{how}")
    eg = facts.get("egress") or {}
    typer.echo("egress:   " + ("allowlists ready (ip_forward not needed)" if eg.get("ready")
                               else "allowlists need " + ", ".join(eg.get("missing", []))))
    _compiled(facts["compiled"])
    for note in facts["notes"]:
        typer.echo(f"note: {note}")


def _compiled(parts: dict[str, Any]) -> None:
    """One line per compiled part: live, or what runs instead and why."""
    for m in [*parts["modules"], parts["agent"]]:
        how = m["path"] if m["live"] else f"{m['state']} ({m['detail']})"
        if not m["live"] and m.get("fallback"):
            how += f": {m['fallback']}"
        typer.echo(f"compiled: {m['name']:11s}{'live' if m['live'] else 'fallback'}  {how}")


@node_app.command("setup")
def setup(
    swap: Annotated[str | None, typer.Option(  # noqa: UP007
        "--swap", help="add a swap file of this size (e.g. 8G), where the operator allows")
                    ] = None,
    swap_file: Annotated[str | None, typer.Option(  # noqa: UP007
        "--swap-file", help="where (default /var/lib/dsec/swapfile; a local disk filesystem)")
                         ] = None,
    ksm: Annotated[bool | None, typer.Option(  # noqa: UP007
        "--ksm/--no-ksm", help="merge identical VM guest pages (kernel same-page merging)")
                   ] = None,
    ksm_pages: Annotated[int | None, typer.Option(  # noqa: UP007
        "--ksm-pages", help="pages KSM scans per wake-up")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Prepare this host for density: a swap file, KSM on and tuned; then report it."""
    from ..api.density import setup_node

    out = setup_node(swap, swap_file, ksm, ksm_pages)
    if json_out:
        print_json(out)
        return
    if "swap" in out:
        sw = out["swap"]
        typer.echo(f"swap file {sw['file']} ({human_bytes(sw['size'])})"
                   + (" was already on" if sw["already"] else " is on"))
    _host(out["host"], False)


@node_app.command("rm")
def rm(name: Annotated[str, typer.Argument()], json_out: JsonOpt = False) -> None:
    """Forget a node (its sandboxes keep running there)."""
    from ..api.cluster import remove_node

    out = remove_node(name)
    if json_out:
        print_json(out)
    else:
        typer.echo(f"removed {name}")


@node_app.command("receive-moved", hidden=True)
def receive_moved(
    sandbox_id: Annotated[str, typer.Argument(help="the moving sandbox's id on this node")],
    state_dir: Annotated[str | None, typer.Option(  # noqa: UP007
        "--state-dir", help="node state directory (default: DSEC_STATE_DIR)")] = None,
) -> None:
    """The receiving end of `dsec thaw ID --to NODE`: a parked VM's files, read as a tar
    stream on stdin, written into this node's incoming dir for it (run/migrate.py)."""
    from ..api.sandboxes import receive_moved

    receive_moved(sandbox_id, sys.stdin.buffer, state_dir)


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")

    @app.command()
    def agent(
        stdio: Annotated[bool, typer.Option("--stdio", help="serve on stdin/stdout (over ssh)")
                         ] = False,
        listen: Annotated[str | None, typer.Option(  # noqa: UP007
            "--listen", help="serve on this unix socket")] = None,
        resident: Annotated[bool, typer.Option(
            "--resident", help="make sure this node's long-lived service runs; print where "
            "it listens (JSON)")] = False,
        state_dir: Annotated[str | None, typer.Option(  # noqa: UP007
            "--state-dir", help="node state directory (default: DSEC_STATE_DIR)")] = None,
    ) -> None:
        """The node service of the cluster: serves the node protocol for `dsec --node`."""
        from ..api.cluster import serve_node

        out = serve_node(stdio, listen, state_dir, resident=resident)
        if out is not None:
            print_json(out)


def render_fanout(failed: list[dict[str, Any]]) -> None:
    """Report the nodes a fan-out skipped (on stderr) and exit 1 if there were any; the
    other nodes' results have been printed already."""
    from .sandbox_io import report_failed_nodes

    code = report_failed_nodes(failed)
    if code:
        raise typer.Exit(code)
