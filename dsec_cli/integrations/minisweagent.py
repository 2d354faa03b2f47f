"""mini-swe-agent on dsec: `DsecEnvironment`, an `Environment` with the semantics of
mini-swe-agent's docker environment (one sandbox per environment, every action a fresh
``bash -lc`` in it, stdout and stderr merged in the order they were written, the docker
environment's result dicts, timeouts included), removed when it is cleaned up, garbage
collected or the interpreter exits.

    from dsec_cli.integrations.minisweagent import DsecEnvironment
    env = DsecEnvironment(image="swe-task@1", cwd="/testbed", timeout=60)

In a config: ``environment_class: dsec_cli.integrations.minisweagent.DsecEnvironment``
(or ``dsec`` once this module is imported: it adds itself to mini-swe-agent's table).
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import subprocess
import threading
import weakref
from typing import Any

from minisweagent import environments
from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from ..api.sandboxes import Sandbox

__all__ = ["DsecEnvironment", "DsecEnvironmentConfig"]

log = logging.getLogger(__name__)

# stderr onto stdout's pipe inside the sandbox: one stream, in the order it was written
_MERGE = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]


class DsecEnvironmentConfig(BaseModel):
    """The docker environment's fields (``cwd``, ``env``, ``forward_env``, ``timeout``,
    ``interpreter``) and the sandbox's create options."""

    image: str
    """A dsec image ref (NAME@VERSION) or an image directory."""
    backend: str = "container"
    cwd: str = "/"
    """Working directory in which to execute commands."""
    env: dict[str, str] = {}
    """Environment variables to set for every command."""
    forward_env: list[str] = []
    """Host environment variables passed on when set; ``env`` wins on a conflict."""
    timeout: int = 30
    """Seconds an action may run."""
    interpreter: list[str] = ["bash", "-lc"]
    """What runs an action: the command is its last argument."""
    ttl: str = "2h"
    """How long the sandbox may live at most (docker's ``container_timeout``): the node
    removes it after that even if this process was killed."""
    cpus: float | None = None
    memory: str | None = None
    pids: int | None = None
    network: str = "none"
    node: str | None = None
    """A cluster node's name, ``auto``, or None for this machine."""


class DsecEnvironment:
    """One dsec sandbox driven as mini-swe-agent's docker environment drives a container."""

    def __init__(self, *, config_class: type = DsecEnvironmentConfig,
                 logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.sandbox: Sandbox | None = None
        self.config = config_class(**kwargs)
        c = self.config
        self.sandbox = Sandbox(c.image, c.backend, cpus=c.cpus, memory=c.memory, pids=c.pids,
                               ttl=c.ttl, network=c.network, node=c.node)
        _live.add(self)
        self.logger.info("Started sandbox %s", self.sandbox.id)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None
                ) -> dict[str, Any]:
        """Run ``action["command"]``; the docker environment's result dict (``output``,
        ``returncode``, ``exception_info``, and ``extra`` on a timeout or an error)."""
        assert self.sandbox is not None, "sandbox not started"
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        argv = [*_MERGE, *self.config.interpreter, command]
        try:
            r = self.sandbox.exec(argv, cwd=cwd or self.config.cwd, env=self._env(),
                                  timeout=limit)
            text = r.stdout.decode("utf-8", errors="replace")
            if r.timed_out:  # what subprocess.run's TimeoutExpired says for docker
                raise subprocess.TimeoutExpired(argv, limit, output=text)
            output: dict[str, Any] = {"output": text, "returncode": r.exit_code,
                                      "exception_info": ""}
        except Exception as e:
            raw = getattr(e, "output", None)
            output = {
                "output": raw if isinstance(raw, str) else "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _env(self) -> dict[str, str]:
        forwarded = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        return {**forwarded, **self.config.env}

    def _check_finished(self, output: dict) -> None:
        """Raises `Submitted` when the output starts with the submission marker (as every
        mini-swe-agent environment does)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" \
                and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
        }}}

    def cleanup(self) -> None:
        """Remove the sandbox (once; later calls do nothing)."""
        with _lock:
            sb, self.sandbox = getattr(self, "sandbox", None), None
        if sb is None:
            return
        _live.discard(self)
        try:
            sb.remove()
        except Exception as e:  # at exit or in a finalizer there is no one to raise to
            log.warning("could not remove sandbox %s: %s", sb.id, e)

    def __del__(self) -> None:
        self.cleanup()


_lock = threading.Lock()
_live: weakref.WeakSet[DsecEnvironment] = weakref.WeakSet()


@atexit.register
def _cleanup_all() -> None:
    """Environments still alive when the interpreter exits: their sandboxes are removed
    now, while the modules that remove them are still whole."""
    for env in list(_live):
        env.cleanup()


def _register() -> None:
    """``environment_class: dsec`` in mini-swe-agent's configs."""
    environments._ENVIRONMENT_MAPPING.setdefault(
        "dsec", f"{__name__}.{DsecEnvironment.__name__}")


_register()
