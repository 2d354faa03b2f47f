"""verifiers' `Runtime` contract on `DsecRuntime`: verifiers' own framework methods
(`run_program`, capped `read`, `with_env`, `alive`, `stop`, the interpreter-exit backstop)
over real container sandboxes, alone and leased to an `AsyncJob`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from tests.run.conftest import IMAGE

pytest.importorskip("verifiers")

from verifiers.v1.errors import SandboxError  # noqa: E402

import dsec_cli as dsec  # noqa: E402
from dsec_cli.integrations.verifiers import DsecConfig, make_runtime  # noqa: E402

from .common import run, sandbox_ids  # noqa: E402


def test_runtime_contract(node_env: dict[str, str]) -> None:
    async def body() -> str:
        rt = make_runtime(DsecConfig(image=IMAGE, workdir="/tmp"))
        rt.env = {"TASK": "t1"}
        await rt.start()
        sid = rt.info.id
        r = await rt.run(["sh", "-c", "echo $TASK $X; pwd; echo oops >&2; exit 4"], {"X": "x"})
        assert (r.exit_code, r.stdout, r.stderr) == (4, "t1 x\n/tmp\n", "oops\n")
        view = rt.with_env({"TASK": "t2"})  # verifiers' view: same box, its own env
        assert (await view.run_program(["sh", "-c", "echo $TASK"], {})).stdout == "t2\n"
        await rt.write("/tmp/answer.txt", b"42\n")
        assert await rt.read("/tmp/answer.txt") == b"42\n"
        assert await rt.read("/tmp/answer.txt", max_bytes=3) == b"42\n"
        with pytest.raises(SandboxError, match="over the 2 byte limit"):
            await rt.read("/tmp/answer.txt", max_bytes=2)
        with pytest.raises(SandboxError):
            await rt.read("/nonexistent")
        assert await rt.alive()
        # a live process: stdin in, stdout out, then its exit code
        proc = await rt.open_process(["sh", "-c", "read line; echo got $line; exit 7"], {})
        await proc.write(b"hello\n")
        assert [c async for c in proc.stdout] == [b"got hello\n"]
        assert await proc.wait() == 7 and await proc.poll() == 7
        forever = await rt.open_process(["sleep", "60"], {})
        assert await forever.poll() is None
        await forever.kill()
        assert await forever.wait() == -9
        await rt.run_background(["sh", "-c", "echo serving; sleep 60"], {}, "/tmp/srv.log")
        for _ in range(100):
            if (await rt.run(["cat", "/tmp/srv.log"], {})).stdout == "serving\n":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the background process wrote nothing")
        await rt.stop()
        return str(sid)

    sid = run(body())
    assert sid not in sandbox_ids(node_env)


def test_rollout_sandboxes_are_the_jobs(node_env: dict[str, str]) -> None:
    async def body() -> None:
        async with await dsec.AsyncJob.start("vf-train", ttl="60s", max_concurrent=4) as job:
            rts = [make_runtime(DsecConfig(image=IMAGE), job=job) for _ in range(2)]
            await asyncio.gather(*(rt.start() for rt in rts))
            live = {ro.sandbox_id for ro in await job.rollouts()}
            assert live == {rt.info.id for rt in rts}
            out = await asyncio.gather(*(rt.run(["sh", "-c", f"echo {i}"], {})
                                         for i, rt in enumerate(rts)))
            assert [r.stdout for r in out] == ["0\n", "1\n"]
            journal = await rts[0].rollout.journal()
            assert any("echo 0" in str(step) for step in journal)  # a journaled step
            await asyncio.gather(*(rt.stop() for rt in rts))
            assert await job.rollouts() == []

    run(body())
    assert sandbox_ids(node_env) == []


def test_interpreter_exit_backstop_removes_the_sandbox(node_env: dict[str, str]) -> None:
    """A runtime whose rollout never reached `stop` (the loop is gone): verifiers'
    atexit hook calls `cleanup`, which removes the sandbox."""
    script = textwrap.dedent(f"""
        import asyncio
        from dsec_cli.integrations.verifiers import DsecConfig, make_runtime
        RT = make_runtime(DsecConfig(image={IMAGE!r}))
        asyncio.run(RT.start())
        print(RT.info.id, flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.split()[0]
    assert sid and sid not in sandbox_ids(node_env)
