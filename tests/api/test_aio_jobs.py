"""Jobs from asyncio on real runc and bubblewrap: `AsyncJob` and `AsyncRollout` give what
`Job` and `Rollout` give, an exec through `AsyncSandbox` into a job's sandbox is a journaled
step as through `Sandbox` (a retried key never runs twice), the heartbeat is a task of the
loop that stops on close, and many journaled execs in flight hold no thread each."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dsec_cli.api.aio import AsyncSandbox, close_sessions
from dsec_cli.api.aio_jobs import AsyncJob, AsyncRollout
from dsec_cli.api.jobs import Job, Rollout
from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import SandboxError, UsageError
from dsec_cli.run.aio import EXECUTOR_THREADS

from .conftest import IMAGE, leaks

CLEAN = {"mounts": [], "cgroups": [], "dirs": []}
WDIR = {"fncall": "/tmp", "container": "/root"}


def _assert_clean(node_env: dict[str, str], name: str) -> None:
    """Nothing of the job is left: no sandbox row, mount, cgroup, dir or job row."""
    from dsec_cli.run.jobs import node_jobs
    from dsec_cli.run.node import local_node

    n = local_node(node_env["DSEC_STATE_DIR"])
    assert n.db.all() == []
    assert leaks(node_env["DSEC_STATE_DIR"]) == CLEAN
    j = node_jobs(n)
    assert j.db.q("SELECT * FROM jobs WHERE name=?", (name,)) == []
    assert j.db.q("SELECT * FROM rollouts WHERE job=?", (name,)) == []
    assert j.db.q("SELECT * FROM slots WHERE job=?", (name,)) == []


async def _poll(what: str, cond: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _holds(ro: AsyncRollout, path: str, data: bytes) -> bool:
    """Whether the rollout's file ``path`` exists and holds ``data``."""
    try:
        return await ro.read_file(path) == data
    except Exception:
        return False


STEP_FIELDS = ("step", "key", "argv", "cwd", "env", "stdin_digest", "state", "exit_code",
               "stdout", "stderr", "timed_out")


def _steps(journal: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: s.get(k) for k in STEP_FIELDS} for s in journal]


@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_async_sandbox_exec_is_journaled_as_sync(backend: str, node_env: dict[str, str]) -> None:
    """Through `AsyncSandbox` and `Sandbox` alike, an exec of a job's sandbox is a step of
    its journal; a key taken by either path never runs again on the other."""
    name = f"sbx-{backend}"
    f = f"{WDIR[backend]}/n"
    cmd = f"echo x >> {f}; wc -l < {f}"

    async def main() -> None:
        job = await AsyncJob.start(name, ttl=60)
        try:
            ro = await job.sandbox(IMAGE, backend)
            assert ro.sandbox_id
            sb, asb = Sandbox.attach(ro.sandbox_id), await AsyncSandbox.attach(ro.sandbox_id)
            s1 = sb.exec(cmd, key="sync")
            a1 = await asb.exec(cmd, key="async", env={"A": "1"}, stdin=b"input")
            assert (s1.stdout.strip(), a1.stdout.strip()) == (b"1", b"2")
            retries = [await asb.exec(cmd, key="sync"), await asb.exec(cmd, key="async"),
                       sb.exec(cmd, key="async"), await ro.exec(cmd, key="async")]
            assert [r.stdout for r in retries] == [s1.stdout, a1.stdout, a1.stdout, a1.stdout]
            got: list[tuple[str, bytes]] = []
            plain = await asb.exec(f"cat {f}", on_output=lambda k, d: got.append((k, d)))
            assert plain.stdout == b"x\nx\n"  # no retry ran
            assert got == [("stdout", b"x\nx\n")]  # the output, once the step is committed
            steps = await ro.journal()
            assert [s["key"] for s in steps] == ["sync", "async", None]
            assert all(s["state"] == "done" and s["exit_code"] == 0 for s in steps)
            assert steps[1]["env"] == {"A": "1"} and steps[1]["argv"] == ["/bin/sh", "-c", cmd]
            assert steps[1]["stdin_digest"] is not None and steps[0]["stdin_digest"] is None
            sync_rollout = Job.attach(name, heartbeat=False).rollouts()[0]
            assert _steps(sync_rollout.journal()) == _steps(steps)
        finally:
            await job.remove()
            await close_sessions()

    asyncio.run(main())
    _assert_clean(node_env, name)


def test_key_needs_a_job_sandbox(node_env: dict[str, str]) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, "fncall") as asb:
            with pytest.raises(UsageError, match="owned by a job"):
                await asb.exec("true", key="k")
            with pytest.raises(UsageError, match="owned by a job"):
                Sandbox.attach(asb.id).exec("true", key="k")
            assert (await asb.exec("echo plain")).stdout == b"plain\n"
        await close_sessions()

    asyncio.run(main())
    assert leaks(node_env["DSEC_STATE_DIR"]) == CLEAN


def _scenario_summary(info: dict[str, Any], ro: dict[str, Any]) -> dict[str, Any]:
    return {"job": {k: info[k] for k in ("ttl", "max_concurrent", "lease", "held", "queued")},
            "rollout": {k: ro[k] for k in ("status", "alive", "steps", "last_step",
                                           "snapshot_step", "backend", "image")}}


def _sync_scenario(name: str, backend: str) -> dict[str, Any]:
    f = f"{WDIR[backend]}/w"
    out: dict[str, Any] = {}
    with Job.start(name, ttl=60, snapshot_every=2, max_concurrent=4) as job:
        ro = job.sandbox(IMAGE, backend)
        out["exec"] = [ro.exec(f"echo a >> {f}; cat {f}", key="k1").stdout,
                       ro.exec(f"echo a >> {f}; cat {f}", key="k1").stdout,
                       ro.exec(["sh", "-c", "cat; exit 3"], stdin="in").exit_code]
        ro.write_file(f"{WDIR[backend]}/data", b"payload", key="w")
        out["read"] = ro.read_file(f"{WDIR[backend]}/data")
        out["snapshot"] = ro.snapshot() is not None
        out["after"] = _scenario_summary(job.info(), ro.info())
        out["park"] = job.park()["lease"]
        out["thaw"] = job.thaw()["lease"]
        out["renew"] = job.renew(ttl=30)["ttl"]
        out["rollouts"] = len(job.rollouts())
        before = ro.journal()
        old = ro.sandbox_id
        ro.replay()
        out["replayed"] = (ro.sandbox_id != old, ro.read_file(f),
                           _steps(ro.journal()) == _steps(before))
        out["journal"] = _steps(ro.journal())
        g = job.group(3, IMAGE, backend)
        g.wait(timeout=120)
        out["group"] = [m.to_dict()["status"] for m in g.members]
        out["group_exec"] = [m.rollout.exec(["echo", str(m.index)]).stdout
                             for m in g.ok() if m.rollout]
        g.members[0].rollout.release()  # type: ignore[union-attr]
        out["released"] = g.members[0].rollout.status  # type: ignore[union-attr]
        out["end"] = _scenario_summary(job.info(), ro.info())
    return out


async def _async_scenario(name: str, backend: str) -> dict[str, Any]:
    f = f"{WDIR[backend]}/w"
    out: dict[str, Any] = {}
    async with await AsyncJob.start(name, ttl=60, snapshot_every=2, max_concurrent=4) as job:
        ro = await job.sandbox(IMAGE, backend)
        out["exec"] = [(await ro.exec(f"echo a >> {f}; cat {f}", key="k1")).stdout,
                       (await ro.exec(f"echo a >> {f}; cat {f}", key="k1")).stdout,
                       (await ro.exec(["sh", "-c", "cat; exit 3"], stdin="in")).exit_code]
        await ro.write_file(f"{WDIR[backend]}/data", b"payload", key="w")
        out["read"] = await ro.read_file(f"{WDIR[backend]}/data")
        out["snapshot"] = await ro.snapshot() is not None
        out["after"] = _scenario_summary(await job.info(), await ro.info())
        out["park"] = (await job.park())["lease"]
        out["thaw"] = (await job.thaw())["lease"]
        out["renew"] = (await job.renew(ttl=30))["ttl"]
        out["rollouts"] = len(await job.rollouts())
        before = await ro.journal()
        old = ro.sandbox_id
        await ro.replay()
        out["replayed"] = (ro.sandbox_id != old, await ro.read_file(f),
                           _steps(await ro.journal()) == _steps(before))
        out["journal"] = _steps(await ro.journal())
        g = await job.group(3, IMAGE, backend)
        await g.wait(timeout=120)
        out["group"] = [m.to_dict()["status"] for m in g.members]
        out["group_exec"] = [(await m.rollout.exec(["echo", str(m.index)])).stdout
                             for m in g.ok() if m.rollout]
        await g.members[0].rollout.release()  # type: ignore[union-attr]
        out["released"] = g.members[0].rollout.status  # type: ignore[union-attr]
        out["end"] = _scenario_summary(await job.info(), await ro.info())
    await close_sessions()
    return out


@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_async_job_equals_sync(backend: str, node_env: dict[str, str]) -> None:
    """The same trajectory through `Job`/`Rollout` and `AsyncJob`/`AsyncRollout`: every
    method gives the same answer, and both leave nothing behind."""
    sync = _sync_scenario(f"eq-sync-{backend}", backend)
    _assert_clean(node_env, f"eq-sync-{backend}")
    aio = asyncio.run(_async_scenario(f"eq-async-{backend}", backend))
    _assert_clean(node_env, f"eq-async-{backend}")
    assert aio == sync
    # what the trajectory says, so that two equally broken paths cannot agree
    assert sync["exec"] == [b"a\n", b"a\n", 3] and sync["read"] == b"payload"
    assert sync["replayed"] == (True, b"a\n", True)
    assert [s["key"] for s in sync["journal"]] == ["k1", None, "w"]
    assert sync["group"] == ["ok"] * 3 and sync["group_exec"] == [b"0\n", b"1\n", b"2\n"]
    assert sync["released"] == "released" and sync["park"] == "parked"
    assert sync["snapshot"] is (backend == "container")


def test_cancelled_journaled_exec_is_no_step(node_env: dict[str, str]) -> None:
    """Cancelling the task awaiting a journaled exec kills the command and drops its step,
    so the same key then runs (once)."""

    async def main() -> None:
        async with await AsyncJob.start("acancel", ttl=60) as job:
            ro = await job.sandbox(IMAGE, "fncall")
            t = asyncio.ensure_future(ro.exec("echo x >> /tmp/c; sleep 600", key="k"))

            await _poll("the command to start", lambda: _holds(ro, "/tmp/c", b"x\n"))
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert await ro.journal() == []
            r = await ro.exec("echo y >> /tmp/c; cat /tmp/c", key="k")
            assert r.stdout == b"x\ny\n"
            assert (await ro.exec("echo z >> /tmp/c", key="k")).stdout == b"x\ny\n"
            assert [s["key"] for s in await ro.journal()] == ["k"]
        await close_sessions()

    asyncio.run(main())
    _assert_clean(node_env, "acancel")


def test_a_key_awaited_many_times_at_once_runs_once(node_env: dict[str, str]) -> None:
    """More concurrent calls with one key than the executor has threads: one runs, the
    others wait for its step in the loop (not in threads) and are served its result."""
    n = EXECUTOR_THREADS + 4

    async def main() -> None:
        async with await AsyncJob.start("asame", ttl=60) as job:
            ro = await job.sandbox(IMAGE, "fncall")
            cmd = "echo x >> /tmp/d; while [ ! -e /tmp/go ]; do sleep 0.1; done; cat /tmp/d"
            calls = [asyncio.ensure_future(ro.exec(cmd, key="same")) for _ in range(n)]

            await _poll("the keyed command to start", lambda: _holds(ro, "/tmp/d", b"x\n"))
            await asyncio.sleep(0.5)  # the others are in the journal or on their way
            sb = await AsyncSandbox.attach(ro.sandbox_id or "")
            await sb.write_file("/tmp/go", b"")
            results = await asyncio.wait_for(asyncio.gather(*calls), 120)
            assert [r.stdout for r in results] == [b"x\n"] * n
            assert [s["key"] for s in await ro.journal()] == ["same"]
        await close_sessions()

    asyncio.run(main())
    _assert_clean(node_env, "asame")


def test_exported_from_the_package_root() -> None:
    import dsec_cli

    assert dsec_cli.AsyncJob is AsyncJob and "AsyncJob" in dsec_cli.__all__


def test_methods_match_the_sync_classes() -> None:
    """Every public method of `Job` and `Rollout` has an awaitable twin."""
    import inspect

    for sync_cls, async_cls in ((Job, AsyncJob), (Rollout, AsyncRollout)):
        for name, fn in inspect.getmembers(sync_cls):
            if name.startswith("_") or not callable(fn):
                continue
            twin = getattr(async_cls, name, None)
            assert twin is not None, f"{async_cls.__name__}.{name} is missing"
            assert inspect.iscoroutinefunction(twin), f"{async_cls.__name__}.{name}"


def test_async_group_reports_a_member_that_could_not_be_made(
        node_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_cli.run.node import Node

    real = Node.create
    calls: list[int] = []
    lock = threading.Lock()

    def create(self, image, opts=None):  # type: ignore[no-untyped-def]
        with lock:
            calls.append(1)
            fail = len(calls) == 2
        if fail:  # one member's create fails as a node fault would
            raise SandboxError("injected: runc failed")
        return real(self, image, opts)

    monkeypatch.setattr(Node, "create", create)

    async def main() -> None:
        async with await AsyncJob.start("agroup", ttl=60, max_concurrent=3) as job:
            g = await job.group(4, IMAGE, "fncall")
            await g.wait(timeout=120)  # the failed member's slot went to the queued one
            assert sorted(m.status for m in g.members) == ["infra_failure", "ok", "ok", "ok"]
            bad = g.failed()
            assert len(bad) == 1 and "injected" in (bad[0].error or "")
            for m in g.ok():
                assert m.rollout is not None
                r = await m.rollout.exec(["echo", str(m.index)])
                assert r.stdout == f"{m.index}\n".encode()
            assert (await job.info())["held"] == 3
        await close_sessions()

    asyncio.run(main())
    _assert_clean(node_env, "agroup")


def test_heartbeat_is_a_task_that_keeps_the_lease_and_stops_on_close(
        node_env: dict[str, str]) -> None:
    async def main() -> None:
        job = await AsyncJob.start("abeat", ttl=1, park_grace=10, reclaim_grace=20)
        try:
            ro = await job.sandbox(IMAGE, "fncall")
            names = {t.get_name() for t in asyncio.all_tasks()}
            assert "job-abeat-heartbeat" in names
            assert not any("abeat" in t.name for t in threading.enumerate())  # no thread
            first = (await job.info())["expires"]

            async def renewed() -> bool:
                return bool((await job.info())["expires"] > first + 0.5)

            await _poll("a heartbeat", renewed)
            assert (await job.info())["lease"] == "active"
            from dsec_cli.api.sandboxes import gc_node

            gc_node()  # the lease holds: nothing parked
            assert (await ro.info())["alive"] and (await job.info())["parked"] is False
            await job.close()
            assert "job-abeat-heartbeat" not in {t.get_name() for t in asyncio.all_tasks()}
            stopped = (await job.info())["expires"]
            await asyncio.sleep(1.5)  # several beats' worth: none comes
            assert (await job.info())["expires"] == stopped
        finally:
            await job.remove()
            await close_sessions()

    asyncio.run(main())
    _assert_clean(node_env, "abeat")


def test_journaled_execs_in_flight_need_no_thread_each(node_env: dict[str, str]) -> None:
    """32 journaled execs in flight at once over 8 rollouts: the thread count, read while
    every one of them is running (each has recorded its start and waits for a file), stays
    within the shared executor's bound; then each is committed as its own step."""
    boxes, per = 8, 4
    n = boxes * per

    async def main() -> tuple[int, int]:
        async with await AsyncJob.start("aflight", ttl=60) as job:
            ros = await asyncio.gather(*(job.sandbox(IMAGE, "fncall") for _ in range(boxes)))
            await asyncio.gather(*(ro.exec("true") for ro in ros))  # connections made
            before = threading.active_count()
            cmd = "echo up >> /tmp/up; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo done"
            execs = [asyncio.ensure_future(ro.exec(cmd, key=f"wait-{i}"))
                     for ro in ros for i in range(per)]

            async def all_up() -> bool:
                async def count(ro: AsyncRollout) -> int:
                    try:
                        return len((await ro.read_file("/tmp/up")).split())
                    except Exception:
                        return 0
                return sum(await asyncio.gather(*(count(ro) for ro in ros))) == n

            await _poll("every exec to start", all_up, timeout=300)
            during = threading.active_count()
            assert not any(t.done() for t in execs)  # every one still in flight
            for ro in ros:
                sb = await AsyncSandbox.attach(ro.sandbox_id or "")
                await sb.write_file("/tmp/go", b"")  # not an exec: no step
            results = await asyncio.gather(*execs)
            assert [r.stdout for r in results] == [b"done\n"] * n
            for ro in ros:
                steps = await ro.journal()
                assert sorted(s["key"] for s in steps if s["key"]) == \
                    sorted(f"wait-{i}" for i in range(per))
                assert len({s["step"] for s in steps}) == per + 1
                assert all(s["state"] == "done" for s in steps)
                again = await ro.exec(cmd, key="wait-0")  # served: /tmp/go is still there,
                assert again.stdout == b"done\n"         # but the journal answers
                assert (await ro.read_file("/tmp/up")).split() == [b"up"] * per
        await close_sessions()
        return before, during

    before, during = asyncio.run(main())
    # the blocking journal writes share the executor's threads; the commands add none
    assert during <= before + EXECUTOR_THREADS + 2, (before, during)
    assert EXECUTOR_THREADS + 2 < n
    _assert_clean(node_env, "aflight")


def test_async_prewarm_thaws_a_parked_job(node_env: dict[str, str]) -> None:
    from dsec_cli.run.node import local_node

    async def main() -> None:
        async with await AsyncJob.start("aprewarm", ttl=60) as job:
            ros = [await job.sandbox(IMAGE, "fncall") for _ in range(2)]
            await job.park()
            n = local_node()
            assert {n.lookup(ro.sandbox_id or "").status for ro in ros} == {"parked"}
            task = await job.prewarm()  # runs while the loop does other work
            assert (await task)["parked"] is False
            assert {n.lookup(ro.sandbox_id or "").status for ro in ros} == {"running"}
            for ro in ros:
                assert (await ro.exec("true")).exit_code == 0
        await close_sessions()

    asyncio.run(main())
    _assert_clean(node_env, "aprewarm")
