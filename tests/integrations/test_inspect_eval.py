"""A real inspect eval with `sandbox=("dsec", config)`: inspect's own eval loop and its
mockllm model, a scripted solver acting in the sandbox, a scorer reading its files; after
the eval no sandbox is left."""

from __future__ import annotations

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
