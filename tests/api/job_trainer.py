"""A trainer for tests/api/test_jobs.py: reattaches to job NAME (rebuilding lost rollouts),
then drives its rollouts through ROUNDS rounds, one keyed step per rollout per round, from
the last round every rollout committed. The test SIGKILLs it at random moments."""

from __future__ import annotations

import sys

from dsec_cli.api.jobs import Job


def main() -> None:
    name, rounds, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    job = Job.resume(name, replay_lost=True)
    rollouts = sorted(job.rollouts(), key=lambda r: r.info()["index"])
    assert len(rollouts) == width, rollouts
    start = min(r.info()["steps"] for r in rollouts)
    print("ready", start, flush=True)
    for rnd in range(start, rounds):
        for ro in rollouts:
            res = ro.exec(f"echo r{rnd} >> /root/log", key=f"r{rnd}")
            assert res.exit_code == 0, res
        print("round", rnd, flush=True)
    job.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
