"""The bodies of the hot sandbox commands (exec, run, ps), shared by their typer commands
(sandbox.py) and the fast launcher (fast.py), without typer: each calls the SDK and renders,
and returns the exit code."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from ..core.errors import UsageError
from .text import terminal_safe

#: bytes of each of stdout and stderr that `--json` puts in its document; past it the
#: field holds the first JSON_OUTPUT_LIMIT bytes and `stdout_truncated` / `stderr_truncated`
#: say so (without --json, output streams through and nothing is kept)
JSON_OUTPUT_LIMIT = 8 << 20


def stream_output(kind: str, data: bytes) -> None:
    out = sys.stdout.buffer if kind == "stdout" else sys.stderr.buffer
    out.write(data)
    out.flush()


def stdin_source() -> Any:
    """Stdin chunks when stdin is a pipe or file (a terminal is not forwarded)."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    fd = sys.stdin.fileno()  # 0, or the client's stdin in the command server

    def chunks() -> Any:
        # raw reads of fd 0 (no buffered reader whose lock a still-blocked feeder thread
        # would hold at interpreter shutdown)
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return
            yield b

    return chunks()


def parse_env(items: list[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"invalid --env {item!r}: expected KEY=VALUE")
        env[k] = v
    return env


def report(res: Any, json_out: bool, sid: str | None = None) -> int:
    """Render an exec result's end (``--json`` document, warnings); the exit code to leave
    with (the command's own)."""
    from .render import err_console, print_json

    if json_out:
        doc = {"exit_code": res.exit_code, "stdout": res.stdout.decode(errors="replace"),
               "stderr": res.stderr.decode(errors="replace"), "duration": res.duration,
               "timed_out": res.timed_out, "oom_killed": res.oom_killed,
               "stdout_truncated": res.stdout_truncated,
               "stderr_truncated": res.stderr_truncated}
        if sid:
            doc["id"] = sid
        print_json(doc)
    if res.timed_out:
        err_console().print("[yellow]dsec: the command timed out and was killed[/]")
    if res.oom_killed:
        err_console().print("[yellow]dsec: the sandbox's memory limit killed the command[/]")
    if res.pids_limited:
        err_console().print("[yellow]dsec: the sandbox hit its process limit[/]")
    return int(res.exit_code)


def ps_table(recs: list[dict[str, Any]]) -> None:
    from .render import table

    t = time.time()
    rows = [(r["id"], r["backend"], r["image"], r["status"], f"{t - r['created']:.0f}s",
             "" if r["expires"] is None else f"{max(0, r['expires'] - t):.0f}s",
             r.get("usage", {}).get("class", ""), _memory(r))
            for r in recs]
    table(None, ["ID", "BACKEND", "IMAGE", "STATUS", "AGE", "TTL LEFT", "CLASS",
                 "MEMORY USED/DECLARED"], rows)


def _memory(r: dict[str, Any]) -> str:
    from .render import human_bytes

    declared = (r.get("limits") or {}).get("memory")
    resident = r.get("usage", {}).get("resident")
    return (f"{'-' if resident is None else human_bytes(resident)}/"
            f"{'-' if declared is None else human_bytes(declared)}")


def sandbox_options(image: str, *, backend: str = "container", cpus: float | None = None,
                    memory: str | None = None, pids: int | None = None, ttl: str | None = None,
                    network: str = "none", disk: str | None = None,
                    env: list[str] | None = None, workdir: str | None = None,
                    timeout: float | None = None, fetch: str = "auto",
                    node_name: str | None = None, cpu_class: str | None = None,
                    user: str | None = None, egress: list[str] | None = None) -> Any:
    """`dsec run`'s options, checked: the `CreateOptions` of the new sandbox."""
    from ..api import sandboxes
    from ..core import validate

    validate.image(image)
    validate.node_option(node_name)
    validate.positive_float(timeout, "--timeout")
    return sandboxes.create_options(backend, cpus=cpus, memory=memory, pids=pids, ttl=ttl,
                                    network=network, env=parse_env(env), workdir=workdir,
                                    fetch=fetch, disk=disk, cpu_class=cpu_class,
                                    prefix="--", user=user, egress=egress)


def create_sandbox(image: str, *, state_dir: str | None = None, node_name: str | None = None,
                   **options: Any) -> Any:
    """`dsec run -d`'s create: the node and the new sandbox's record."""
    from ..api import sandboxes

    opts = sandbox_options(image, node_name=node_name, **options)
    return sandboxes.create(image, opts, node_name, state_dir)


def exec_command(sandbox: str, cmd: list[str], *, env: list[str] | None = None,
                 workdir: str | None = None, timeout: float | None = None,
                 json_out: bool = False, state_dir: str | None = None,
                 node: str | None = None, user: str | None = None) -> int:
    """`dsec exec`: stream the command's output, exit with its code."""
    from ..api.sandboxes import exec_in
    from ..core import validate

    validate.positive_float(timeout, "--timeout")
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("exec needs a command, e.g. `dsec exec ID -- ls /`")
    res = exec_in(sandbox, cmd, node=node, state_dir=state_dir, env=parse_env(env),
                  cwd=workdir, stdin=stdin_source(), timeout=timeout,
                  on_output=None if json_out else stream_output,
                  capture_limit=JSON_OUTPUT_LIMIT if json_out else 0,
                  **({} if user is None else {"user": user}))
    return report(res, json_out)


def list_sandboxes(json_out: bool, state_dir: str | None, node: str | None,
                   all_nodes: bool) -> int:
    """`dsec ps`; 1 when a node of an ``all_nodes`` fan-out did not answer."""
    from ..api.sandboxes import ps as list_all
    from .render import print_json

    recs, failed = list_all(state_dir, node, all_nodes=all_nodes)
    if json_out:
        print_json({"sandboxes": recs, "failed": failed} if all_nodes else recs)
    else:
        ps_table(recs)
    return report_failed_nodes(failed)


def report_failed_nodes(failed: list[dict[str, Any]]) -> int:
    """Report the nodes a fan-out skipped (on stderr); 1 if there were any (the other nodes'
    results have been printed already)."""
    if not failed:
        return 0
    from rich.text import Text

    from .render import err_console

    for f in failed:  # what a node said, shown as text (as the error printer does)
        what = "unreachable, skipped" if f.get("unreachable") else "failed"
        err_console().print(Text.assemble((f"node {f['node']} {what}:", "yellow"), " ",
                                          terminal_safe(str(f["error"]))), highlight=False)
    return 1
