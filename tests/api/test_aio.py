"""The asyncio SDK on real runc and bubblewrap: every `AsyncSandbox` method gives what the
same `Sandbox` method gives, and concurrent execs wait in the event loop, not in threads."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import dsec_cli
from dsec_cli.api.aio import AsyncSandbox, close_sessions
from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import NotFoundError, UsageError
from dsec_cli.run.aio import EXECUTOR_THREADS

from .conftest import IMAGE, leaks

NO_LEAKS = {"mounts": [], "cgroups": [], "dirs": []}


def _same(a: Any, b: Any) -> None:
    """Two exec results agree on everything but the time taken."""
    assert (a.exit_code, a.stdout, a.stderr, a.timed_out, a.stdout_truncated) == \
        (b.exit_code, b.stdout, b.stderr, b.timed_out, b.stdout_truncated)


async def _blocks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        await asyncio.sleep(0)
        yield p


def test_exported_from_the_package_root() -> None:
    assert dsec_cli.AsyncSandbox is AsyncSandbox
    assert "AsyncSandbox" in dsec_cli.__all__


def test_async_nodes_keep_the_node_contract() -> None:
    """This node's and a cluster node's async faces offer the same coroutines, with the
    parameters of the node contract's methods, so a sandbox routes to either alike."""
    import inspect

    from dsec_cli.run.aio import AsyncNode
    from dsec_cli.run.cluster.aio import AsyncRemoteNode
    from dsec_cli.run.contract import NodeAPI

    names = ["create", "lookup", "describe", "pause", "resume", "snapshot", "fork", "remove",
             "exec", "put_file", "get_file", "get_file_with_mode", "copy"]
    for name in names:
        local, remote = getattr(AsyncNode, name), getattr(AsyncRemoteNode, name)
        assert inspect.iscoroutinefunction(local) and inspect.iscoroutinefunction(remote)
        params = list(inspect.signature(local).parameters)
        assert params == list(inspect.signature(remote).parameters), name
        if hasattr(NodeAPI, name):
            assert params == list(inspect.signature(getattr(NodeAPI, name)).parameters), name


def test_async_sandbox_has_every_method_of_sandbox_as_a_coroutine() -> None:
    import inspect

    sync = {n for n, v in vars(Sandbox).items() if not n.startswith("_") and callable(v)
            and not isinstance(v, classmethod)}
    for name in sync:
        fn = getattr(AsyncSandbox, name, None)
        assert fn is not None and inspect.iscoroutinefunction(fn), name


def test_async_park_thaw_class_and_egress(node_env: dict[str, str]) -> None:
    from dsec_cli.backends import _cgroups
    from dsec_cli.run.node import local_node

    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, "container", cpu_class="latency",
                                             network="allowlist",
                                             egress=["host:9"]) as sb:
            parked = await sb.park()
            assert parked["status"] == "parked" and sb.status == "parked"
            cg = _cgroups.Cgroup(f"{local_node().cgroup_parent}/{sb.id}")
            assert cg.frozen()
            assert (await sb.thaw())["status"] == "running" and sb.status == "running"
            assert (await sb.exec("true")).exit_code == 0
            files = cg.cpu_class_files()  # the latency class reached the sandbox's group
            assert files.get("cpu.shares", files.get("cpu.weight")) in (10240, 1000), files
            await sb.set_egress(["host:10"])
            assert (await sb.info())["egress"]["rules"] == ["host:10"]
        await close_sessions()

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_async_equals_sync(backend: str, node_env: dict[str, str], tmp_path: Path) -> None:
    """Each method, awaited, against the sync method on the same sandbox."""
    wdir = "/tmp" if backend == "fncall" else "/root"

    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, backend, memory="64M",
                                             env={"A": "1"}) as sb:
            sync = Sandbox.attach(sb.id)
            assert (sb.backend, sb.image, sb.status) == (backend, IMAGE, "running")
            # exec: shell string, argv, env, cwd, exit code, stderr, timeout
            for cmd, kw in [("echo $A $B; echo err >&2; exit 3", {"env": {"B": "2"}}),
                            (["/bin/pwd"], {"cwd": "/etc"}),
                            ("sleep 5", {"timeout": 0.5}),
                            ("seq 1 20000", {"capture_limit": 100})]:
                a = await sb.exec(cmd, **kw)  # type: ignore[arg-type]
                _same(a, sync.exec(cmd, **kw))  # type: ignore[arg-type]
            assert (await sb.exec("echo $A $B; exit 3", env={"B": "2"})).stdout == b"1 2\n"
            assert (await sb.exec("sleep 5", timeout=0.5)).timed_out
            # stdin: bytes, str, an async iterable, a plain iterable
            for stdin in (b"bytes\n", "text\n", [b"a", b"b\n"]):
                _same(await sb.exec("cat; echo .", stdin=stdin),
                      sync.exec("cat; echo .", stdin=stdin))
            r = await sb.exec(["cat"], stdin=_blocks(b"x" * 3_000_000, b"end"))
            assert r.stdout == b"x" * 3_000_000 + b"end"
            # streamed output, to a function and to a coroutine function
            seen: list[tuple[str, bytes]] = []

            async def acb(kind: str, data: bytes) -> None:
                seen.append((kind, data))

            got: list[tuple[str, bytes]] = []
            a = await sb.exec("echo out; echo err >&2", on_output=acb)
            s = sync.exec("echo out; echo err >&2", on_output=lambda k, d: got.append((k, d)))
            _same(a, s)
            assert sorted(seen) == sorted(got) == [("stderr", b"err\n"), ("stdout", b"out\n")]
            # files, both ways and across the two APIs
            await sb.write_file(f"{wdir}/f", "async")
            assert sync.read_file(f"{wdir}/f") == b"async"
            sync.write_file(f"{wdir}/g", b"sync")
            assert await sb.read_file(f"{wdir}/g") == b"sync"
            big = bytes(range(256)) * 20000  # several agent frames
            await sb.write_file(f"{wdir}/big", big, mode=0o600)
            assert await sb.read_file(f"{wdir}/big") == big == sync.read_file(f"{wdir}/big")
            assert (await sb.exec(f"stat -c %a {wdir}/big")).stdout == b"600\n"
            with pytest.raises(NotFoundError):
                await sb.read_file("/nonexistent")
            with pytest.raises(NotFoundError):
                sync.read_file("/nonexistent")
            with pytest.raises(UsageError, match="absolute"):
                await sb.read_file("relative")
            with pytest.raises(UsageError, match="needs a command"):
                await sb.exec([])
            # cp in and out
            (tmp_path / "in.txt").write_bytes(b"from host")
            await sb.copy_in(tmp_path / "in.txt", f"{wdir}/in.txt")
            assert sync.read_file(f"{wdir}/in.txt") == b"from host"
            await sb.copy_out(f"{wdir}/f", tmp_path / "out-a")
            sync.copy_out(f"{wdir}/f", tmp_path / "out-s")
            assert (tmp_path / "out-a").read_bytes() == (tmp_path / "out-s").read_bytes() \
                == b"async"
            # pause / resume: a paused sandbox refuses execs in both APIs
            await sb.pause()
            assert sb.status == "paused" and (await sb.info())["status"] == "paused"
            with pytest.raises(UsageError, match="paused"):
                await sb.exec("true")
            with pytest.raises(UsageError, match="paused"):
                sync.exec("true")
            await sb.resume()
            assert (await sb.exec("echo back")).stdout == b"back\n"
            info, sinfo = await sb.info(), sync.info()
            stable = ("id", "status", "backend", "image", "image_digest", "created", "limits",
                      "network", "pid", "runtime", "paused")  # not the memory in use
            assert info["id"] == sb.id and info["status"] == "running"
            assert {k: info.get(k) for k in stable} == {k: sinfo.get(k) for k in stable}
            # snapshot: a layer for container, the same refusal as sync for fncall
            if backend == "container":
                snap = await sb.snapshot("aio-snap@1")
                assert snap["image"] == "aio-snap@1" and snap["layer_digest"]
            else:
                with pytest.raises(UsageError) as e1:
                    await sb.snapshot("aio-snap@1")
                with pytest.raises(UsageError) as e2:
                    sync.snapshot("aio-snap@1")
                assert e1.value.message == e2.value.message
            # fork
            copies = await sb.fork(2)
            try:
                for c in copies:
                    assert isinstance(c, AsyncSandbox) and c.backend == backend
                    assert await c.read_file(f"{wdir}/f") == b"async"
                await copies[0].write_file(f"{wdir}/f", "changed")
                assert await copies[1].read_file(f"{wdir}/f") == b"async"
                assert await sb.read_file(f"{wdir}/f") == b"async"
            finally:
                for c in copies:
                    await c.remove()
            attached = await AsyncSandbox.attach(sb.id)
            assert (await attached.exec("echo hi")).stdout == b"hi\n"
        with pytest.raises(NotFoundError):
            await AsyncSandbox.attach(sb.id)  # removed on leaving the block
        await close_sessions()

    asyncio.run(main())
    assert leaks(node_env["DSEC_STATE_DIR"]) == NO_LEAKS


def test_bad_options_are_refused_before_anything_is_made(node_env: dict[str, str]) -> None:
    async def main() -> None:
        for kw, what in [({"memory": "lots"}, "memory"), ({"cpus": -1}, "cpus"),
                         ({"node": "a b"}, "node")]:
            with pytest.raises(UsageError, match=what):
                await AsyncSandbox.create(IMAGE, "fncall", **kw)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="backend"):
            await AsyncSandbox.create(IMAGE, "nosuch")

    asyncio.run(main())
    assert leaks(node_env["DSEC_STATE_DIR"]) == NO_LEAKS


def test_cancelled_exec_is_killed(node_env: dict[str, str]) -> None:
    """Cancelling the awaiting task ends the command in the sandbox."""

    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, "fncall") as sb:
            started = asyncio.Event()
            task = asyncio.ensure_future(sb.exec("echo up; exec sleep 600",
                                                 on_output=lambda k, d: started.set()))
            await asyncio.wait_for(started.wait(), 60)
            assert b"sleep 600" in (await sb.exec("ps -o args")).stdout
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60
            while b"sleep 600" in (await sb.exec("ps -o args")).stdout:
                assert time.monotonic() < deadline, "the cancelled command still runs"
                await asyncio.sleep(0.1)
            assert (await sb.exec("echo alive")).stdout == b"alive\n"  # connection still fine
        await close_sessions()

    asyncio.run(main())
    assert leaks(node_env["DSEC_STATE_DIR"]) == NO_LEAKS


@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_concurrent_execs_need_no_thread_each(backend: str, node_env: dict[str, str]) -> None:
    """N execs in flight at once, each in its own sandbox: the process's thread count is
    read while all of them are running (each has printed and waits for its stdin) and
    stays below a bound that does not grow with N."""
    n = 100 if backend == "fncall" else 50

    async def main() -> tuple[int, int]:
        boxes = await asyncio.gather(*(AsyncSandbox.create(IMAGE, backend, memory="32M")
                                       for _ in range(n)))
        try:
            release = asyncio.Event()
            running = 0
            all_running = asyncio.Event()

            def started(kind: str, data: bytes) -> None:
                nonlocal running
                running += 1
                if running == n:
                    all_running.set()

            async def gated_stdin() -> AsyncIterator[bytes]:
                await release.wait()
                yield b"released"

            before = threading.active_count()
            execs = [asyncio.ensure_future(sb.exec("echo up; cat", stdin=gated_stdin(),
                                                   on_output=started)) for sb in boxes]
            await asyncio.wait_for(all_running.wait(), 300)
            during = threading.active_count()
            assert not any(t.done() for t in execs)  # every one still in flight
            release.set()
            results = await asyncio.gather(*execs)
            assert [r.stdout for r in results] == [b"up\nreleased"] * n
            return before, during
        finally:
            await asyncio.gather(*(sb.remove() for sb in boxes))
            await close_sessions()

    before, during = asyncio.run(main())
    # the shared executor (creates, removes) is the only pool; execs add no thread
    assert during <= before + 2, (before, during)
    assert during < EXECUTOR_THREADS + 20 < n, (before, during)
    assert leaks(node_env["DSEC_STATE_DIR"]) == NO_LEAKS


def test_sandbox_dying_mid_exec_is_an_error_not_a_hang(node_env: dict[str, str]) -> None:
    import os
    import signal

    from dsec_cli.core.errors import SandboxError

    async def main() -> None:
        sb = await AsyncSandbox.create(IMAGE)  # a container: its init is the agent
        try:
            started = asyncio.Event()
            task = asyncio.ensure_future(sb.exec("echo up; exec sleep 600",
                                                 on_output=lambda k, d: started.set()))
            await asyncio.wait_for(started.wait(), 60)
            pid = Sandbox.attach(sb.id).node.lookup(sb.id).handle["pid"]
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(SandboxError, match="lost the connection"):
                await asyncio.wait_for(task, 60)
            from dsec_cli.backends._rootfs import alive

            deadline = time.monotonic() + 60
            while alive(pid, None):  # the kill is delivered asynchronously
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            with pytest.raises(SandboxError, match="no longer running"):
                await sb.exec("true")
        finally:
            await sb.remove()
            await close_sessions()

    asyncio.run(main())
    assert leaks(node_env["DSEC_STATE_DIR"]) == NO_LEAKS


def test_agent_socket_of_another_process_is_refused(tmp_path: Path) -> None:
    """The asyncio client checks who listens (SO_PEERCRED) before sending a byte."""
    import socket

    from dsec_cli.backends.sandbox_agent.aio import AsyncAgentClient
    from dsec_cli.backends.sandbox_agent.client import AgentError

    path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    seen: list[int] = []

    async def main() -> None:
        def not_ours(pid: int) -> bool:
            seen.append(pid)
            return False

        with pytest.raises(AgentError, match="refusing the agent socket"):
            await AsyncAgentClient.connect_unix(path, peer=not_ours, what="sandbox x")

    try:
        asyncio.run(main())
        conn, _ = srv.accept()
        conn.settimeout(10)
        assert conn.recv(1) == b""  # closed without a byte sent
        conn.close()
    finally:
        srv.close()
    import os

    assert seen == [os.getpid()]


@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_async_exec_counts_as_activity(backend: str, node_env: dict[str, str]) -> None:
    """An exec over the loop's agent connection marks the sandbox active, as `Node.exec`
    does: `dsec top` and idle reclaim do not take a sandbox driven from asyncio for idle."""
    from dsec_cli.run import density
    from dsec_cli.run.node import local_node

    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, backend) as sb:
            active = local_node().sandboxes_dir / sb.id / density.ACTIVE
            active.touch()
            os.utime(active, (1_000_000, 1_000_000))  # idle since 1970
            assert (await sb.exec("true")).exit_code == 0
            assert time.time() - active.stat().st_mtime < 60
            idle = {r["id"]: r["idle_seconds"] for r in local_node().top()}
            assert idle[sb.id] < 60
        await close_sessions()

    asyncio.run(main())


def test_async_thaw_takes_to_as_sandbox_thaw_does(node_env: dict[str, str]) -> None:
    """``thaw(to=...)`` moves a parked VM as `Sandbox.thaw` does, with its checks: no
    ``prefetch`` beside it, and no move to the node it is on."""
    from types import SimpleNamespace

    from dsec_cli.run.aio import AsyncNode
    from dsec_cli.run.node import local_node

    async def main() -> None:
        rec = SimpleNamespace(id="abc123", backend="microvm", image=IMAGE, status="parked")
        sb = AsyncSandbox(rec, AsyncNode(local_node()))
        with pytest.raises(UsageError, match="--prefetch does not go with --to"):
            await sb.thaw(prefetch=True, to="node2")
        with pytest.raises(UsageError, match="already on node local"):
            await sb.thaw(to="local")

    asyncio.run(main())
