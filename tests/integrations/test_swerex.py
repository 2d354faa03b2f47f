"""SWE-ReX's runtime interface on `DsecDeployment`/`DsecRuntime`, driven with its own request
and action types, in real container sandboxes: persistent shell sessions, exit codes,
timeouts and interrupts, commands, file operations."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run.conftest import IMAGE

pytest.importorskip("swerex")

from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from dsec_cli.integrations.swerex import DsecDeployment, DsecDeploymentConfig  # noqa: E402

from .common import run, sandbox_ids  # noqa: E402


def test_sessions_commands_and_files(node_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "tools" / "bin").mkdir(parents=True)
    (tmp_path / "tools" / "bin" / "hello").write_text("#!/bin/sh\necho hello $1\n")
    (tmp_path / "tools" / "bin" / "hello").chmod(0o755)
    (tmp_path / "tools" / "README").write_text("tools\n")

    async def body() -> str:
        dep = DsecDeploymentConfig(image=IMAGE).get_deployment()
        assert isinstance(dep, DsecDeployment)
        with pytest.raises(DeploymentNotStartedError):
            dep.runtime  # noqa: B018
        await dep.start()
        sid = dep.sandbox.id
        rt = dep.runtime
        assert await dep.is_alive()
        await rt.create_session(CreateBashSessionRequest())
        with pytest.raises(SessionExistsError):
            await rt.create_session(CreateBashSessionRequest())
        s = rt.run_in_session
        # the shell persists: variables, functions and the working directory carry over
        assert (await s(BashAction(command="export X=42; cd /tmp"))).exit_code == 0
        obs = await s(BashAction(command="f() { echo f$1; }; pwd; echo $X"))
        assert obs.output == "/tmp\n42\n" and obs.exit_code == 0
        assert (await s(BashAction(command="f 7; echo err >&2"))).output == "f7\nerr\n"
        obs = await s(BashAction(command="printf 'no newline'"))
        assert obs.output == "no newline"
        assert (await s(BashAction(command="false", check="silent"))).exit_code == 1
        assert (await s(BashAction(command="false", check="ignore"))).exit_code is None
        with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
            await s(BashAction(command="sh -c 'exit 3'"))
        with pytest.raises(BashIncorrectSyntaxError):
            await s(BashAction(command="echo (", check="silent"))
        assert (await s(BashAction(command="echo $X"))).output == "42\n"  # still there
        # a command past its timeout, then interrupted: the session goes on
        with pytest.raises(CommandTimeoutError):
            await s(BashAction(command="echo started; sleep 60", timeout=1))
        await s(BashInterruptAction(timeout=5))
        obs = await s(BashAction(command="echo $X; pwd", timeout=5))
        assert obs.output == "42\n/tmp\n"
        # a second session is a separate shell
        await rt.create_session(CreateBashSessionRequest(session="other"))
        obs = await s(BashAction(command="echo ${X-unset}", session="other"))
        assert obs.output == "unset\n"
        await rt.close_session(CloseBashSessionRequest(session="other"))
        with pytest.raises(SessionDoesNotExistError):
            await s(BashAction(command="true", session="other"))
        # commands in fresh processes, as subprocess.run
        r = await rt.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 2"]))
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 2)
        r = await rt.execute(Command(command="echo $Y; pwd", shell=True, cwd="/etc",
                                     env={"Y": "why"}, merge_output_streams=True))
        assert r.stdout == "why\n/etc\n"
        with pytest.raises(NonZeroExitCodeError):
            await rt.execute(Command(command="false", shell=True, check=True))
        with pytest.raises(CommandTimeoutError):
            await rt.execute(Command(command=["sleep", "30"], timeout=1))
        # files
        await rt.write_file(WriteFileRequest(path="/work/a/b.txt", content="ünïcode\n"))
        got = await rt.read_file(ReadFileRequest(path="/work/a/b.txt"))
        assert got.content == "ünïcode\n"
        await rt.upload(UploadRequest(source_path=str(tmp_path / "tools"),
                                      target_path="/opt/tools"))
        obs = await s(BashAction(command="/opt/tools/bin/hello rex; cat /opt/tools/README"))
        assert obs.output == "hello rex\ntools\n"
        await dep.stop()
        return sid

    sid = run(body())
    assert sid not in sandbox_ids(node_env)


ACTIONS = [
    "export A=1; cd /tmp",
    "echo $A; pwd",
    "echo out; echo err >&2",
    "printf 'a\\nb'",
    "false",
    "sh -c 'exit 5'",
    "for i in 1 2 3; do echo $i; done",
    "x() { echo in-x; }; x",
    "cat <<EOF\nheredoc line\nEOF",
    "echo one\necho two",
    "",
]


def test_sessions_answer_as_swerex_local_runtime() -> None:
    """The same actions through SWE-ReX's own `LocalRuntime` (a bash under pexpect on this
    host) and through `DsecRuntime`: the same outputs and exit codes."""
    from swerex.runtime.local import LocalRuntime

    async def observe(rt) -> list[tuple[str, int | None]]:  # type: ignore[no-untyped-def]
        await rt.create_session(CreateBashSessionRequest())
        out = []
        for cmd in ACTIONS:
            obs = await rt.run_in_session(BashAction(command=cmd, check="silent", timeout=10))
            # pexpect's tty ends lines with \r\n and leaves blank lines around the output
            out.append((obs.output.replace("\r\n", "\n").strip(), obs.exit_code))
        await rt.close()
        return out

    async def body() -> tuple[list, list]:  # type: ignore[type-arg]
        want = await observe(LocalRuntime())
        dep = DsecDeployment(image=IMAGE)
        await dep.start()
        try:
            return want, await observe(dep.runtime)
        finally:
            await dep.stop()

    want, got = run(body())
    assert got == want


def test_sandbox_removed_at_interpreter_exit(node_env: dict[str, str]) -> None:
    """A deployment started and never stopped: its sandbox is gone once the interpreter
    has exited."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import asyncio
        from dsec_cli.integrations.swerex import DsecDeployment
        DEP = DsecDeployment(image={IMAGE!r})
        asyncio.run(DEP.start())
        print(DEP.sandbox.id, flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.split()[0]
    assert sid and sid not in sandbox_ids(node_env)
