"""mini-swe-agent's own agent loop (`DefaultAgent`, its scripted `DeterministicModel`) on
`DsecEnvironment`: real container sandboxes, the docker environment's result shapes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tests.run.conftest import IMAGE

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
# mini-swe-agent makes its config dir at import: never the user's
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-"))
pytest.importorskip("minisweagent")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from dsec_cli.integrations.minisweagent import DsecEnvironment  # noqa: E402

from .common import sandbox_ids  # noqa: E402

SH = ["sh", "-c"]  # the busybox image has no bash


def test_agent_loop_runs_commands_and_submits(node_env: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASK_TOKEN", "from-the-host")
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    steps = [
        "echo one; echo two >&2; echo three; echo four >&2",  # one stream, in order
        "pwd; echo $GREETING $TASK_TOKEN ${NOT_SET_ANYWHERE-unset}",
        "echo patched > /tmp/fix.txt; exit 3",
        "printf 'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\\n'; cat /tmp/fix.txt",
    ]
    model = DeterministicModel(outputs=[make_output(f"step {i}", [{"command": c}])
                                        for i, c in enumerate(steps)])
    env = get_environment({"environment_class": "dsec", "image": IMAGE, "cwd": "/etc",
                           "interpreter": SH, "env": {"GREETING": "hello"},
                           "forward_env": ["TASK_TOKEN", "NOT_SET_ANYWHERE"]})
    assert isinstance(env, DsecEnvironment)
    try:
        agent = DefaultAgent(model, env, system_template="sys", instance_template="{{task}}",
                             step_limit=10, cost_limit=0)
        result = agent.run("fix it")
        assert result == {"exit_status": "Submitted", "submission": "patched\n"}
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "<returncode>0</returncode>\n<output>\none\ntwo\nthree\nfour\n</output>" \
            in observations[0]
        assert "/etc\nhello from-the-host unset\n" in observations[1]
        assert "<returncode>3</returncode>" in observations[2]
        assert env.serialize()["info"]["config"]["environment_type"] == \
            "dsec_cli.integrations.minisweagent.DsecEnvironment"
        assert env.get_template_vars()["cwd"] == "/etc"
    finally:
        sid = env.sandbox.id
        env.cleanup()
    assert sid not in sandbox_ids(node_env)


def test_timeout_result_is_shaped_as_dockers() -> None:
    env = DsecEnvironment(image=IMAGE, interpreter=SH, timeout=1)
    try:
        out = env.execute({"command": "echo before; sleep 30; echo after"})
        assert out["returncode"] == -1
        assert out["output"] == "before\n"
        assert out["extra"]["exception_type"] == "TimeoutExpired"
        assert out["exception_info"].startswith(
            "An error occurred while executing the command: Command ")
        assert out["exception_info"].endswith("timed out after 1 seconds")
        # the sandbox is still usable, with a per-call timeout and cwd
        out = env.execute({"command": "pwd"}, cwd="/tmp", timeout=5)
        assert out == {"output": "/tmp\n", "returncode": 0, "exception_info": ""}
    finally:
        env.cleanup()
    env.cleanup()  # twice is fine


def test_sandbox_removed_at_interpreter_exit(node_env: dict[str, str]) -> None:
    """An environment never cleaned up (held by a module global until the interpreter
    ends) leaves no sandbox behind."""
    script = textwrap.dedent(f"""
        import dsec_cli.integrations.minisweagent
        from minisweagent.environments import get_environment
        ENV = get_environment({{"environment_class": "dsec", "image": {IMAGE!r},
                               "interpreter": ["sh", "-c"]}})
        print(ENV.sandbox.id, flush=True)
        assert ENV.execute({{"command": "echo up"}})["output"] == "up\\n"
    """)
    before = set(sandbox_ids(node_env))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, "MSWEA_SILENT_STARTUP": "1"}, timeout=120)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.split()[0]
    assert sid and sid not in sandbox_ids(node_env)
    assert set(sandbox_ids(node_env)) <= before


def test_results_match_minisweagents_local_environment() -> None:
    """The same actions through mini-swe-agent's own `LocalEnvironment` (``sh -c`` on this
    host) and through `DsecEnvironment`: the same result dicts."""
    from minisweagent.environments.local import LocalEnvironment

    actions = ["echo a; echo b >&2; echo c", "exit 7", "printf 'no newline'",
               "cd /tmp && pwd", "echo $GREETING", "ls /nonexistent-dir"]
    local = LocalEnvironment(cwd="/", env={"GREETING": "hi", "LC_ALL": "C"})
    env = DsecEnvironment(image=IMAGE, interpreter=SH, env={"GREETING": "hi"})
    try:
        for cmd in actions[:-1]:
            assert env.execute({"command": cmd}) == local.execute({"command": cmd}), cmd
        got = env.execute({"command": actions[-1]})  # busybox's ls words it its own way
        want = local.execute({"command": actions[-1]})
        assert want["returncode"] != 0 and got["returncode"] != 0  # GNU ls 2, busybox 1
        assert "nonexistent-dir" in got["output"]
    finally:
        env.cleanup()
