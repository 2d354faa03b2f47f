"""skyrl-gym's env API (`skyrl_gym.make`, `init`, `step`, `close`) on `DsecCodeEnv` and its
`DsecToolGroup`, with scripted actions, in real container sandboxes, alone and as a
`Job`'s rollouts."""

from __future__ import annotations

import pytest

from tests.run.conftest import IMAGE

pytest.importorskip("skyrl_gym")

import skyrl_gym  # noqa: E402

import dsec_cli as dsec  # noqa: E402
import dsec_cli.integrations.skyrl  # noqa: E402, F401  (registers dsec-code)

from .common import sandbox_ids  # noqa: E402


def test_episode_with_tools_and_reward(node_env: dict[str, str]) -> None:
    env = skyrl_gym.make("dsec-code", env_config={"image": IMAGE, "timeout": 2},
                         extras={"check": "grep -q fixed /tmp/state", "max_turns": 6})
    sid = env.tools.sandbox.id
    prompt = [{"role": "user", "content": "fix it"}]
    assert env.init(prompt) == (prompt, {})
    out = env.step("<tool><bash>echo a; echo b >&2; echo c</bash></tool>")
    assert out["observations"] == [{"role": "user", "content": "a\nb\nc\n"}]
    assert (out["reward"], out["done"]) == (0.0, False)
    out = env.step("<tool><bash>echo broken > /tmp/state; false</bash></tool>")
    assert out["observations"][0]["content"] == "(exit code 1)"
    out = env.step("<tool><bash>sleep 30</bash></tool>")
    assert out["observations"][0]["content"].endswith("timed out after 2 seconds.")
    out = env.step("<tool><python>print(1)</python></tool>")  # no python in busybox
    assert out["observations"][0]["content"].startswith("Error executing Python code: ")
    out = env.step("<tool><bash>echo fixed > /tmp/state</bash></tool>")
    out = env.step("<solution>done</solution>")
    assert (out["reward"], out["done"]) == (1.0, True)
    env.close()
    assert sid not in sandbox_ids(node_env)


def test_episodes_lease_the_jobs_sandboxes(node_env: dict[str, str]) -> None:
    with dsec.Job.start("skyrl-train", ttl="60s", max_concurrent=2) as job:
        envs = [skyrl_gym.make("dsec-code", env_config={"image": IMAGE, "job": job},
                               extras={"check": "test -f /tmp/done", "max_turns": 2})
                for _ in range(2)]
        assert {r.sandbox_id for r in job.rollouts()} == \
            {e.tools.sandbox.id for e in envs}
        envs[0].step("<tool><bash>touch /tmp/done</bash></tool>")
        assert envs[0].step("<solution>ok</solution>")["reward"] == 1.0
        assert envs[1].step("<tool><bash>true</bash></tool>")["done"] is False
        assert envs[1].step("stop")["reward"] == 0.0  # max_turns reached, check fails
        steps = envs[0].tools.rollout.journal()
        assert any("touch /tmp/done" in str(s) for s in steps)
        for e in envs:
            e.close()
        assert job.rollouts() == []
    assert sandbox_ids(node_env) == []
