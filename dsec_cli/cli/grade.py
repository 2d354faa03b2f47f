"""`dsec git-scrub`, `dsec git-check` and `dsec grade`: clean task images and scoring in a
fork (thin: parse, call dsec_cli.api.grading, render)."""

from __future__ import annotations

from typing import Annotated

import typer

from .render import human_bytes, print_json

_STORE = typer.Option("--store", help="store URL (default: local)")
_JSON = typer.Option("--json", help="machine-readable output")


def register(app: typer.Typer) -> None:
    @app.command("git-scrub")
    def git_scrub(
        ref: Annotated[str, typer.Argument(help="layer or image NAME@VERSION holding the repo")],
        path: Annotated[str, typer.Option("--path", help="the repository's path in the layer")],
        as_ref: Annotated[str, typer.Option("--as", help="NAME@VERSION of the new layer")],
        base: Annotated[str, typer.Option("--base", help="the task's base revision")] = "HEAD",
        store: Annotated[str | None, _STORE] = None,
        as_json: Annotated[bool, _JSON] = False,
    ) -> None:
        """Write a new layer: REF with the git repository at --path reduced to one commit
        holding --base's tree (no other commits, tags, reflogs, remotes or stray objects)."""
        from ..api.grading import git_scrub_layer

        out = git_scrub_layer(ref, path, base=base, as_ref=as_ref, store=store)
        if as_json:
            print_json(out)
        else:
            typer.echo(f"{out['ref']} {out['digest'][:12]}: {path} at {base} "
                       f"({human_bytes(out['size_before'])} -> {human_bytes(out['size'])})")

    @app.command("git-check")
    def git_check(
        ref: Annotated[str, typer.Argument(help="layer or image NAME@VERSION")],
        path: Annotated[str, typer.Option("--path", help="the repository's path in the layer")],
        store: Annotated[str | None, _STORE] = None,
        as_json: Annotated[bool, _JSON] = False,
    ) -> None:
        """Exit 0 when the repository at --path holds one parentless commit and nothing
        beyond it; else list what reaches past it and exit 1."""
        from ..api.grading import git_check as check

        found = check(ref, path, store=store)
        if as_json:
            print_json({"path": found.path, "clean": found.clean, "problems": found.problems})
        else:
            for p in found.problems:
                typer.echo(p)
            typer.echo(f"{ref}:{path}: " + ("clean" if found.clean else
                                            f"{len(found.problems)} problem(s)"))
        if not found.clean:
            raise typer.Exit(1)

    @app.command("start-task")
    def start_task(
        sandbox: Annotated[str, typer.Argument(help="the agent's sandbox")],
        as_json: Annotated[bool, _JSON] = False,
    ) -> None:
        """Record the digests of the task's protected paths now (after setup, before the
        agent acts); `dsec grade` reports what the agent changed, created or deleted since."""
        from ..api.grading import start_task as start

        out = start(sandbox)
        if as_json:
            print_json(out)
        else:
            typer.echo(f"{out['sandbox']}: {out['protected']} protected path(s) recorded")

    @app.command("grade")
    def grade(
        sandbox: Annotated[str, typer.Argument(help="the agent's sandbox")],
        grader: Annotated[str, typer.Option("--grader", help="grader image NAME@VERSION")],
        timeout: Annotated[str | None, typer.Option(
            "--timeout", help="the grader command's limit (default: the grader's own)")] = None,
        as_json: Annotated[bool, _JSON] = False,
    ) -> None:
        """Score SANDBOX in a fork: the task image plus the grader's hidden tests, only the
        agent's changes on the patch surface, no network. Exit 0 when graded (whatever the
        reward), 1 when the grading itself failed."""
        from ..api.grading import grade as run_grade

        result = run_grade(sandbox, grader, timeout=timeout)
        if as_json:
            print_json(result.to_dict())
        else:
            for t in result.tests:
                typer.echo(f"{t.outcome:8} {t.name}")
            for d in result.dropped:
                typer.echo(f"dropped  {d['path']} ({d['why']})")
            tamper = ", ".join(f"{k} {', '.join(v)}" for k, v in result.tamper.items() if v)
            typer.echo(f"reward {result.reward:g}" + (" (timed out)" if result.timed_out else "")
                       + (f"; tampered: {tamper}" if result.tampered else "")
                       + (f"; grading failed: {result.infra_error}" if result.infra_error
                          else ""))
        if result.infra_error:
            raise typer.Exit(1)

    @app.command("egress")
    def egress(
        sandbox: Annotated[str, typer.Argument(help="a sandbox created with network allowlist")],
        rules: Annotated[list[str] | None, typer.Argument(
            help="host, host:PORT, IPV4:PORT or NAME:PORT; none given: nothing may leave",
            show_default=False)] = None,
        as_json: Annotated[bool, _JSON] = False,
    ) -> None:
        """Replace a running sandbox's egress allowlist, enforced on the host's side."""
        from ..api.sandboxes import Sandbox

        out = Sandbox.attach(sandbox).set_egress(rules or [])
        if as_json:
            print_json(out)
        else:
            typer.echo(f"{sandbox}: egress {', '.join(out.get('rules', [])) or 'none'} "
                       f"(gateway {out.get('gateway')}, {out.get('dropped', 0)} dropped)")
