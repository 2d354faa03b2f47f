"""The SDK behaviour the inspect-ai adapter relies on, checked on real container sandboxes:
exec as another user from asyncio, file errors that carry their errno, the workdir in
`info`, and removal at interpreter exit."""

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
