"""The SDK behaviour the inspect-ai adapter relies on, checked on real container sandboxes:
exec as another user from asyncio, file errors that carry their errno, the workdir in
`info`, removal at interpreter exit, and a command left running whose output is collected
later (`AsyncSandbox.spawn`)."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import textwrap

import pytest

import dsec_cli
from dsec_cli import AsyncSandbox, Sandbox
from tests.integrations.conftest import IMAGE


def test_async_exec_as_user_and_file_errnos() -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, workdir="/tmp") as sb:
            assert (await sb.exec(["id", "-u"], user="65534")).stdout == b"65534\n"
            assert (await sb.exec(["id", "-u"])).stdout == b"0\n"
            with pytest.raises(dsec_cli.NotFoundError) as e:
                await sb.read_file("/nonexistent")
            assert (e.value.errno, e.value.filename) == (errno.ENOENT, "/nonexistent")
            with pytest.raises(dsec_cli.DsecError) as e2:
                await sb.read_file("/etc")
            assert e2.value.errno == errno.EISDIR
            assert (await sb.info())["workdir"] == "/tmp"
        await dsec_cli.close_sessions()

    asyncio.run(main())


def test_sync_info_has_workdir() -> None:
    with Sandbox(IMAGE, workdir="/root") as sb:
        assert sb.info()["workdir"] == "/root"


def test_removed_at_interpreter_exit(node_env: dict[str, str]) -> None:
    """A sandbox made with remove_at_exit and never removed is gone once its process ends
    (where a __del__ would fail on a half torn-down interpreter)."""
    code = textwrap.dedent(f"""
        import dsec_cli
        sb = dsec_cli.Sandbox({IMAGE!r}, remove_at_exit=True)
        kept = dsec_cli.Sandbox({IMAGE!r})
        print(sb.id, kept.id)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **node_env}, timeout=120)
    assert p.returncode == 0, p.stderr
    gone, kept = p.stdout.split()
    ids = {r["id"] for r in dsec_cli.list_sandboxes()}
    assert gone not in ids and kept in ids
    Sandbox.attach(kept).remove()


def test_spawned_process_output_is_kept_for_later() -> None:
    """A command left running: output that arrives after the call returns is kept for a
    later read, stdin stays open, and killing it ends it in the sandbox."""
    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE) as sb:
            proc = await sb.spawn("echo first; sleep 0.5; echo later; echo err >&2; cat")
            await asyncio.sleep(1.5)  # nobody reads while the command writes
            assert proc.read() == (b"first\nlater\n", b"err\n")
            await proc.write("from stdin\n")
            chunks = []
            async for stream, data in proc:
                chunks.append((stream, data))
                if b"from stdin" in data:
                    break
            assert chunks == [("stdout", b"from stdin\n")]
            await proc.close_stdin()
            res = await proc.wait(timeout=30)
            assert (res.exit_code, proc.returncode) == (0, 0)

            sleeper = await sb.spawn(["sh", "-c", "echo $$ > /tmp/pid; exec sleep 600"])
            await asyncio.sleep(0.5)
            pid = (await sb.read_file("/tmp/pid")).decode().strip()
            await sleeper.kill()
            assert sleeper.returncode == -9 and (await sleeper.wait()).exit_code == -9
            alive = await sb.exec(["kill", "-0", pid])
            assert alive.exit_code != 0  # gone from the sandbox, not only from the handle

            both = await sb.spawn("echo o1; echo e1 >&2; sleep 0.2; echo o2; echo e2 >&2")
            errs = [d async for d in both.stream("stderr")]
            assert b"".join(errs) == b"e1\ne2\n"  # stdout kept for its own reader
            assert b"".join([d async for d in both.stream("stdout")]) == b"o1\no2\n"
            assert both.returncode == 0

            small = await sb.spawn("head -c 3000 /dev/zero", keep=1000)
            res = await small.wait(timeout=30)
            assert (small.dropped, small.read()) == (2000, (b"\0" * 1000, b""))
        await dsec_cli.close_sessions()

    asyncio.run(main())
