"""A real inspect eval with `sandbox=("dsec", config)`: inspect's own eval loop and its
mockllm model, a scripted solver acting in the sandbox, a scorer reading its files; after
the eval no sandbox is left, and none after an eval killed mid-sample once its job's lease
has lapsed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai")

from inspect_ai import Task, eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer  # noqa: E402
from inspect_ai.solver import Generate, TaskState, solver  # noqa: E402
from inspect_ai.util import sandbox  # noqa: E402

import dsec_cli  # noqa: E402
from tests.integrations.conftest import IMAGE  # noqa: E402


@solver
def act():  # type: ignore[no-untyped-def]
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        r = await sandbox().exec(["sh", "-c", f"echo {state.input} > answer; id -u"])
        state.metadata["uid"] = r.stdout.strip()
        return state

    return solve


@scorer(metrics=[accuracy()])
def answer():  # type: ignore[no-untyped-def]
    async def score(state: TaskState, target: Target) -> Score:
        text = (await sandbox().read_file("answer")).strip()
        return Score(value=CORRECT if text == target.text else INCORRECT, answer=text)

    return score


def test_eval_with_dsec_sandbox(tmp_path: Path) -> None:
    config = tmp_path / "dsec.yaml"
    config.write_text(f"image: {IMAGE}\nuser: '1000:1000'\nworkdir: /home/agent\n")
    task = Task(dataset=[Sample(input=f"w{i}", target=f"w{i}") for i in range(4)],
                solver=act(), scorer=answer(), sandbox=("dsec", str(config)))
    [log] = eval(task, model="mockllm/model", log_dir=str(tmp_path / "logs"),
                 display="none")
    assert log.status == "success", log.error
    assert log.results is not None
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    assert all(s.metadata["uid"] == "1000" for s in log.samples or [])
    assert dsec_cli.list_sandboxes() == []


def _ended_early(p: subprocess.Popen[bytes], logs: Path) -> str:
    """Why an eval ended before its sample hung: its stderr and the errors its log holds."""
    from inspect_ai.log import read_eval_log

    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    for f in sorted(logs.glob("*.eval")):
        log = read_eval_log(str(f))
        err += f"\n{f.name}: {log.status} {log.error}"
        err += "".join(f"\n  sample: {s.error}" for s in log.samples or [] if s.error)
    return err


def test_killed_eval_leaves_nothing(tmp_path: Path, node_env: dict[str, str]) -> None:
    """An eval killed mid-sample (no cleanup runs) leaves its sandbox on the task's job,
    whose lease lapses: the node removes the sandbox by itself, no `dsec gc` run."""
    import os
    import signal
    import sys
    import textwrap
    import time

    from dsec_cli.api.jobs import list_jobs

    config = tmp_path / "dsec.yaml"
    # the lease outlasts a stall of the eval's loop (its heartbeat is a task of that loop,
    # and a loaded machine can hold inspect's start-up for seconds)
    config.write_text(f"image: {IMAGE}\nlease: 8s\nreclaim_grace: 2s\n")
    (tmp_path / "task.py").write_text(textwrap.dedent(f"""
        from inspect_ai import Task, eval
        from inspect_ai.dataset import Sample
        from inspect_ai.solver import solver
        from inspect_ai.util import sandbox

        @solver
        def hang():
            async def solve(state, generate):
                await sandbox().exec(["sh", "-c", "touch /tmp/started; sleep 600"])
                return state
            return solve

        eval(Task(dataset=[Sample(input="x")], solver=hang(),
                  sandbox=("dsec", {str(config)!r})),
             model="mockllm/model", log_dir={str(tmp_path / "logs")!r}, display="none")
    """))
    p = subprocess.Popen([sys.executable, str(tmp_path / "task.py")],
                         env={**os.environ, **node_env}, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not dsec_cli.list_sandboxes():
            assert p.poll() is None, _ended_early(p, tmp_path / "logs")
            assert time.monotonic() < deadline, "the eval made no sandbox"
            time.sleep(0.2)
        [job] = [j for j in list_jobs() if j["name"].startswith("inspect-")]
        time.sleep(1)  # the sample is in its command
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    deadline = time.monotonic() + 60
    while dsec_cli.list_sandboxes() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = dsec_cli.list_sandboxes()
    log = Path(node_env["DSEC_STATE_DIR"], "reaper.log")
    assert left == [], (left, log.read_text() if log.exists() else "no reaper ran")
    dsec_cli.Job.attach(job["name"], heartbeat=False).remove()
