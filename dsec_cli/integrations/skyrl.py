"""skyrl-gym on dsec: `DsecToolGroup`, a skyrl-gym `ToolGroup` whose tools (``bash``,
``python``) run in a dsec sandbox instead of the trainer's host, and `DsecCodeEnv`, a
multi-turn text environment (registered as ``dsec-code``) that calls them and scores the
episode with a check command in the same sandbox. With a `Job`, the sandbox is one of the
job's rollouts (its execs journaled, its slot under the job's cap).

    env = skyrl_gym.make("dsec-code", env_config={"image": "task@1"},
                         extras={"check": "make test", "max_turns": 8})
    obs, _ = env.init(prompt)
    out = env.step("<tool><bash>ls</bash></tool>")
    env.close()
"""

from __future__ import annotations

import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.envs.registration import register, registry
from skyrl_gym.tools.core import ToolGroup, tool

from ..api.jobs import Job, Rollout
from ..api.sandboxes import Sandbox

__all__ = ["DsecCodeEnv", "DsecToolGroup"]

_TOOL = re.compile(r"<tool>\s*<(\w+)>(.*?)</\1>\s*</tool>", re.DOTALL)


class DsecToolGroup(ToolGroup):
    """``bash`` and ``python`` tools in one sandbox, made here (``image``) or given
    (``sandbox``); with ``job``, made as one of the job's rollouts. `close` removes what it
    made (a job's rollout is released: its journal stays)."""

    def __init__(self, image: str | None = None, backend: str = "container", *,
                 sandbox: Sandbox | None = None, job: Job | None = None,
                 timeout: float = 10.0, **options: Any) -> None:
        self.timeout = timeout
        self.rollout: Rollout | None = None
        self._owned = sandbox is None
        if sandbox is None:
            if image is None:
                raise ValueError("DsecToolGroup needs an image or a sandbox")
            if job is not None:
                self.rollout = job.sandbox(image, backend, **options)
                sandbox = Sandbox.attach(str(self.rollout.sandbox_id))
            else:
                sandbox = Sandbox(image, backend, **options)
        self.sandbox: Sandbox | None = sandbox
        super().__init__(name="DsecToolGroup")

    def _box(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("the tool group's sandbox was closed")
        return self.sandbox

    @tool
    def bash(self, command: str) -> str:
        """The command's stdout and stderr (merged, in order) and its exit code when it
        failed."""
        r = self._box().exec(["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", "/bin/sh", "-c",
                              command], timeout=self.timeout)
        out = r.stdout.decode(errors="replace")
        if r.timed_out:
            return f"{out}Error: Execution timed out after {self.timeout} seconds."
        return out if r.exit_code == 0 else f"{out}(exit code {r.exit_code})"

    @tool
    def python(self, code: str) -> str:
        """As skyrl-gym's `PythonCodeExecutorToolGroup.python`, in the sandbox."""
        r = self._box().exec(["python", "-c", code], timeout=self.timeout)
        if r.timed_out:
            return ("Error executing Python code: Execution timed out after "
                    f"{self.timeout} seconds.")
        if r.stderr:
            return f"Error executing Python code: {r.stderr.decode(errors='replace').strip()}"
        return r.stdout.decode(errors="replace").strip()

    def close(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if self.rollout is not None:
            self.rollout.release()
        elif sb is not None and self._owned:
            sb.remove()


class DsecCodeEnv(BaseTextEnv):
    """Multi-turn: each action may call ``<tool><bash>...</bash></tool>`` (or ``python``);
    the episode ends at ``<solution>...</solution>`` or after ``max_turns``, when
    ``extras["check"]`` runs in the sandbox: reward 1.0 if it exits 0, else 0.0.

    ``env_config``: ``image`` (required), ``backend``, ``timeout`` and the sandbox's create
    options; ``job`` (a `Job`) leases the sandbox to a trainer's job."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        config = dict(env_config or {})
        extras = dict(extras or {})
        self.check: str | None = extras.get("check")
        self.max_turns = int(extras.get("max_turns", 4))
        self.tools = DsecToolGroup(config.pop("image"), config.pop("backend", "container"),
                                   **config)
        self.init_tool_groups([self.tools])
        self.chat_history: ConversationType = []

    def _reward(self) -> float:
        if self.check is None:
            return 0.0
        return 1.0 if self.tools._box().exec(self.check).exit_code == 0 else 0.0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.chat_history.append({"role": "assistant", "content": action})
        info: dict[str, Any] = {"tool_name": None}
        m = _TOOL.search(action)
        if m:
            name, arg = m.group(1), m.group(2).strip()
            info["tool_name"] = name
            try:
                observation = self._execute_tool(self.tools.name, name, [arg])
            except ValueError as e:  # a tool this group does not have
                observation = str(e)
            self.chat_history.append({"role": "user", "content": observation})
        done = self.turns >= self.max_turns or ("<solution>" in action
                                                and "</solution>" in action)
        reward = self._reward() if done else 0.0
        obs = [] if done or not m else [self.chat_history[-1]]
        return BaseTextEnvStepOutput(observations=obs, reward=reward, done=done, metadata=info)

    def close(self) -> None:
        self.tools.close()


if "dsec-code" not in registry:
    register(id="dsec-code", entry_point=f"{__name__}:DsecCodeEnv")
