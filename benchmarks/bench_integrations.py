"""The same scripted inspect-ai episode (32 rollouts, 8 steps each: an exec in the sandbox
per step) with ``sandbox="dsec"`` and with inspect's ``local`` provider, both in this run:
wall time of each eval and the sandbox's cost per step. Needs the inspect extra and root.

    python -m benchmarks.bench_integrations [STORE_URL]   # a store holding busybox@1.35-1

The two evals take turns, RUNS times; the figures are medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROLLOUTS, STEPS = 32, 8
RUNS = 3
IMAGE = "busybox@1.35-1"


def _task(spec: object):  # type: ignore[no-untyped-def]
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import Generate, TaskState, solver
    from inspect_ai.util import sandbox

    @solver
    def steps():  # type: ignore[no-untyped-def]
        async def solve(state: TaskState, generate: Generate) -> TaskState:
            for i in range(STEPS):
                await sandbox().exec(["sh", "-c", f"echo {i} >> /tmp/steps-$$; true"])
            return state

        return solve

    return Task(dataset=[Sample(input=str(i)) for i in range(ROLLOUTS)], solver=steps(),
                sandbox=spec)


def _eval(spec: object, logs: str) -> float:
    from inspect_ai import eval

    t = time.perf_counter()
    [log] = eval(_task(spec), model="mockllm/model", log_dir=logs, display="none",
                 max_sandboxes=ROLLOUTS)
    assert log.status == "success", log.error
    return time.perf_counter() - t


def main() -> None:
    import os

    if len(sys.argv) > 1:
        os.environ["DSEC_STORE"] = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "dsec.yaml"
        cfg.write_text(f"image: {IMAGE}\n")
        locals_, dsecs = [], []
        for i in range(RUNS):
            locals_.append(_eval("local", f"{d}/local{i}"))
            dsecs.append(_eval(("dsec", str(cfg)), f"{d}/dsec{i}"))
    local, dsec = statistics.median(locals_), statistics.median(dsecs)
    n = ROLLOUTS * STEPS
    out = {"rollouts": ROLLOUTS, "steps": STEPS, "runs": RUNS, "local_s": round(local, 3),
           "dsec_s": round(dsec, 3), "ratio": round(dsec / local, 2),
           "overhead_per_step_ms": round((dsec - local) / n * 1000, 2)}
    Path(__file__).with_name("results").joinpath("integrations_inspect.json").write_text(
        json.dumps(out, indent=2) + "\n")
    print(f"| inspect-ai, {ROLLOUTS}x{STEPS} steps | local {local:.2f}s | dsec {dsec:.2f}s | "
          f"{dsec / local:.2f}x | +{out['overhead_per_step_ms']} ms/step |")


if __name__ == "__main__":
    main()
