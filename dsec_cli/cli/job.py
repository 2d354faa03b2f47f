"""`dsec job start|ls|renew|park|thaw|rm`, `dsec journal ID` and `dsec replay ID` (thin:
parse, call dsec_cli.api.jobs, render)."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any

import typer

from .render import print_json, table

job_app = typer.Typer(help="Jobs: sandboxes owned through a lease, with a journal of every "
                           "exec (docs/jobs.md).", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
StateOpt = Annotated[str | None, typer.Option(  # noqa: UP007
    "--state-dir", help="node state directory (default: DSEC_STATE_DIR or the config's)")]
NameArg = Annotated[str, typer.Argument(help="job name")]
Secs = Annotated[str | None, typer.Option()]  # noqa: UP007


def _when(t: float | None) -> str:
    if t is None:
        return ""
    d = t - time.time()
    return f"in {d:.0f}s" if d >= 0 else f"{-d:.0f}s ago"


def _show(doc: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print_json(doc)
    else:
        _jobs_table([doc])


def _jobs_table(docs: list[dict[str, Any]]) -> None:
    table(None, ["job", "lease", "expires", "rollouts", "lost", "held", "queued", "queue ETA",
                 "cap"],
          [[d["name"], d["lease"], _when(d["expires"]), d["rollouts"], d["lost"], d["held"],
            d["queued"], "" if d["queue_eta"] is None else f"{d['queue_eta']:.0f}s",
            d["max_concurrent"] or "-"] for d in docs])


@job_app.command("start")
def start(
    name: NameArg,
    ttl: Annotated[str, typer.Option(help="lease length; `dsec job renew` extends it")] = "10m",
    park_grace: Annotated[str, typer.Option(
        help="after the lease expires, pause the job's sandboxes after this long")] = "1m",
    reclaim_grace: Annotated[str, typer.Option(
        help="after the lease expires, remove the job's sandboxes after this long")] = "10m",
    retain: Annotated[str, typer.Option(
        help="keep journals and snapshots this long after a reclaim")] = "1h",
    max_concurrent: Annotated[int, typer.Option(
        help="rollouts held at once (0: no cap); more wait in the queue")] = 0,
    snapshot_every: Annotated[int, typer.Option(
        help="snapshot a rollout every N steps (0: never by count)")] = 20,
    snapshot_interval: Annotated[str, typer.Option(
        help="snapshot a rollout after this long since the last (0: never by time)")] = "5m",
    json_out: JsonOpt = False,
    state_dir: StateOpt = None,
) -> None:
    """Start a job on this node; its lease lasts --ttl unless renewed."""
    from ..api.jobs import start_job

    _show(start_job(name, state_dir, ttl=ttl, park_grace=park_grace,
                    reclaim_grace=reclaim_grace, retain=retain, max_concurrent=max_concurrent,
                    snapshot_every=snapshot_every, snapshot_interval=snapshot_interval),
          json_out)


@job_app.command("ls")
def ls(
    name: Annotated[str | None, typer.Argument(  # noqa: UP007
        help="a job: list its rollouts")] = None,
    json_out: JsonOpt = False,
    state_dir: StateOpt = None,
) -> None:
    """List jobs (lease, rollouts, queue and its ETA), or one job's rollouts."""
    from ..api.jobs import job_rollouts, list_jobs

    if name is None:
        docs = list_jobs(state_dir)
        if json_out:
            print_json(docs)
        else:
            _jobs_table(docs)
        return
    rows = job_rollouts(name, state_dir)
    if json_out:
        print_json(rows)
        return
    table(None, ["rollout", "sandbox", "status", "alive", "group", "steps", "snapshot at",
                 "image"],
          [[r["id"], r["sandbox"], r["status"], "yes" if r["alive"] else "no",
            "" if r["group"] is None else f"{r['group']}[{r['index']}]", r["steps"],
            r["snapshot_step"] or "", r["image"]] for r in rows])


@job_app.command("renew")
def renew(name: NameArg, ttl: Secs = None, json_out: JsonOpt = False,
          state_dir: StateOpt = None) -> None:
    """Extend a job's lease (by its ttl, or --ttl) from now; thaws what the lease parked."""
    from ..api.jobs import renew_job

    _show(renew_job(name, ttl, state_dir), json_out)


@job_app.command("park")
def park(name: NameArg, json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Pause every sandbox of a job (state kept; `dsec job thaw` resumes them)."""
    from ..api.jobs import park_job

    _show(park_job(name, state_dir), json_out)


@job_app.command("thaw")
def thaw(name: NameArg, json_out: JsonOpt = False, state_dir: StateOpt = None,
         prefetch: Annotated[bool, typer.Option(
             "--prefetch", help="also read the sandboxes' memory back from swap now, "
             "ahead of need")] = False) -> None:
    """Resume a parked job's sandboxes."""
    from ..api.jobs import thaw_job

    _show(thaw_job(name, state_dir, prefetch), json_out)


@job_app.command("rm")
def rm(name: NameArg, json_out: JsonOpt = False, state_dir: StateOpt = None) -> None:
    """Remove a job: its sandboxes, journal, snapshot refs and rows."""
    from ..api.jobs import remove_job

    out = remove_job(name, state_dir)
    if json_out:
        print_json(out)
    else:
        typer.echo(f"removed job {out['name']} ({len(out['removed'])} sandboxes)")


def _text(b: bytes) -> str:
    return b.decode(errors="replace")


def register(app: typer.Typer) -> None:
    app.add_typer(job_app, name="job")

    @app.command()
    def journal(
        rollout: Annotated[str, typer.Argument(
            help="rollout id or job sandbox id (NODE/ID on a cluster node)")],
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
    ) -> None:
        """A rollout's steps (number, key, command, exit code, state digests, duration) and
        its grades (reward, tests passed and failed, tamper).

        With --json: the steps, then the grades (``"kind": "grade"``, each with the step it
        followed and the whole result)."""
        from ..api.jobs import grades as grades_of
        from ..api.jobs import journal as steps

        docs = steps(rollout, True, state_dir)
        grades = grades_of(rollout, state_dir)
        if json_out:
            for d in docs:  # output is bytes: base64 keeps it exact
                d["stdout"] = base64.b64encode(d["stdout"]).decode()
                d["stderr"] = base64.b64encode(d["stderr"]).decode()
            print_json(docs + grades)
            return
        from ..api.sandboxes import shell_join

        table(None, ["step", "key", "command", "exit", "before", "after", "duration"],
              [[d["step"], d["key"] or "", shell_join(d["argv"])[:60],
                d.get("exit_code", d["state"]), (d["digest_before"] or "")[:12],
                (d["digest_after"] or "")[:12],
                "" if d["duration"] is None else f"{d['duration'] * 1000:.1f} ms"]
               for d in docs])
        if grades:
            table("grades", ["grade", "after step", "grader", "reward", "passed", "failed",
                             "tampered", "infra error"],
                  [[g["grade"], g["after_step"], g["grader"], f"{g['reward']:g}",
                    g["tests_passed"], g["tests_failed"], "yes" if g["tampered"] else "no",
                    g["infra_error"][:60]] for g in grades])

    @app.command()
    def replay(
        rollout: Annotated[str, typer.Argument(help="rollout id or job sandbox id")],
        json_out: JsonOpt = False,
        state_dir: StateOpt = None,
    ) -> None:
        """Rebuild a rollout in a fresh sandbox: its image, its last snapshot, and the
        journal's later steps re-executed with their state digests checked."""
        from ..api.jobs import replay as rebuild

        doc = rebuild(rollout, state_dir)
        if json_out:
            print_json(doc)
        else:
            typer.echo(f"rollout {doc['id']} rebuilt as sandbox {doc['sandbox']} "
                       f"({doc['steps']} steps, from snapshot at step {doc['snapshot_step']})")
