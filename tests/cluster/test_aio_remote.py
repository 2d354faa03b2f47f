"""The asyncio SDK against real nodes over SSH: the same results as the threaded API, and
many execs in flight on one asyncio session without a thread each."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from dsec_cli.api.aio import AsyncSandbox, close_sessions
from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import NotFoundError, UsageError

from .conftest import IMAGE
from .sshnodes import SshCluster


def test_async_remote_sandbox(client: SshCluster, tmp_path: Path) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, node="node2") as sb:
            assert sb.id.startswith("node2/")
            sync = Sandbox.attach(sb.id)
            for cmd, kw in [("echo $B; echo err >&2; exit 3", {"env": {"B": "2"}}),
                            (["/bin/pwd"], {"cwd": "/etc"}),
                            ("cat; echo .", {"stdin": b"in\n"})]:
                a = await sb.exec(cmd, **kw)  # type: ignore[arg-type]
                s = sync.exec(cmd, **kw)  # type: ignore[arg-type]
                assert (a.exit_code, a.stdout, a.stderr) == (s.exit_code, s.stdout, s.stderr)
            seen: list[tuple[str, bytes]] = []

            async def acb(kind: str, data: bytes) -> None:
                seen.append((kind, data))

            await sb.exec("echo out; echo err >&2", on_output=acb)
            assert sorted(seen) == [("stderr", b"err\n"), ("stdout", b"out\n")]
            await sb.write_file("/srv/f", "async")
            assert sync.read_file("/srv/f") == b"async" == await sb.read_file("/srv/f")
            with pytest.raises(NotFoundError):
                await sb.read_file("/nonexistent")
            (tmp_path / "in.txt").write_bytes(b"from host")
            await sb.copy_in(tmp_path / "in.txt", "/srv/in.txt")
            await sb.copy_out("/srv/in.txt", tmp_path / "out.txt")
            assert (tmp_path / "out.txt").read_bytes() == b"from host"
            await sb.pause()
            with pytest.raises(UsageError, match="paused"):
                await sb.exec("true")
            await sb.resume()
            assert (await sb.info())["node"] == "node2"
            copies = await sb.fork(2)
            try:
                assert all(c.id.startswith("node2/") for c in copies)
                await copies[0].write_file("/srv/f", "changed")
                assert await copies[1].read_file("/srv/f") == b"async"
                assert await sb.read_file("/srv/f") == b"async"
            finally:
                for c in copies:
                    await c.remove()
            attached = await AsyncSandbox.attach(sb.id)
            assert (await attached.exec("echo hi")).stdout == b"hi\n"
        with pytest.raises(NotFoundError):
            await AsyncSandbox.attach(sb.id)
        async with await AsyncSandbox.create(IMAGE, "fncall", node="auto") as placed:
            assert placed.id.split("/")[0] in ("node1", "node2", "node3")
            assert (await placed.exec("echo placed")).stdout == b"placed\n"
        await close_sessions()

    asyncio.run(main())


def test_async_remote_execs_in_flight_need_no_thread_each(client: SshCluster) -> None:
    n = 24  # within the node service's 32 request workers per session

    async def main() -> tuple[int, int]:
        boxes = await asyncio.gather(*(AsyncSandbox.create(IMAGE, "fncall", node="node3")
                                       for _ in range(4)))
        try:
            all_running = asyncio.Event()
            running = 0

            def started(kind: str, data: bytes) -> None:
                nonlocal running
                running += 1
                if running == n:
                    all_running.set()

            before = threading.active_count()
            # stdin goes to a node whole, so the gate is a file the commands wait for
            execs = [asyncio.ensure_future(boxes[i % 4].exec(
                f"echo up; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo {i}",
                on_output=started)) for i in range(n)]
            await asyncio.wait_for(all_running.wait(), 300)
            during = threading.active_count()
            assert not any(t.done() for t in execs)
            for sb in boxes:
                await sb.write_file("/tmp/go", "")
            results = await asyncio.gather(*execs)
            assert [r.exit_code for r in results] == [0] * n
            return before, during
        finally:
            await asyncio.gather(*(sb.remove() for sb in boxes))
            await close_sessions()

    before, during = asyncio.run(main())
    assert during <= before + 2, (before, during)
