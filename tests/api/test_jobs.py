"""Jobs on real runc and bubblewrap: keyed execs run once, the trainer killed at random
moments resumes every rollout to the state of an uninterrupted run, replay rebuilds a lost
sandbox and checks its state digests, a group reports a member that could not be made as an
infrastructure failure, and a job whose lease lapses is parked, then reclaimed with nothing
left behind."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec_cli.api.jobs import Job
from dsec_cli.core.errors import NotFoundError, SandboxError

from .conftest import IMAGE, leaks

TRAINER = Path(__file__).with_name("job_trainer.py")
REPO = Path(__file__).resolve().parents[2]
CLEAN = {"mounts": [], "cgroups": [], "dirs": []}


def _node(node_env: dict[str, str]):  # type: ignore[no-untyped-def]
    from dsec_cli.run.node import local_node

    return local_node(node_env["DSEC_STATE_DIR"])


def _jobs(node_env: dict[str, str]):  # type: ignore[no-untyped-def]
    from dsec_cli.run.jobs import node_jobs

    return node_jobs(_node(node_env))


def _assert_clean(node_env: dict[str, str], name: str) -> None:
    """Nothing of the job is left: no sandbox row, process, mount, cgroup, dir or job row."""
    n = _node(node_env)
    assert n.db.all() == []
    assert leaks(node_env["DSEC_STATE_DIR"]) == CLEAN
    j = _jobs(node_env)
    for table in ("jobs", "rollouts", "slots"):
        col = "name" if table == "jobs" else "job"
        assert j.db.q(f"SELECT * FROM {table} WHERE {col}=?", (name,)) == []
    assert j.db.q("SELECT * FROM steps") == []


def _poll(what: str, cond, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_keyed_exec_runs_once_and_is_journaled(node_env: dict[str, str]) -> None:
    with Job.start("once", ttl=60) as job:
        ro = job.sandbox(IMAGE, "container")
        first = ro.exec("echo x >> /root/n; wc -l < /root/n", key="turn-1", env={"A": "1"},
                        stdin=b"input")
        again = ro.exec("echo x >> /root/n; wc -l < /root/n", key="turn-1")
        assert first.stdout.strip() == b"1" and again.stdout == first.stdout
        assert ro.exec("cat /root/n").stdout == b"x\n"  # the retry ran nothing
        steps = ro.journal()
        assert [s["key"] for s in steps] == ["turn-1", None]
        s = steps[0]
        assert s["argv"] == ["/bin/sh", "-c", "echo x >> /root/n; wc -l < /root/n"]
        assert s["env"] == {"A": "1"} and s["exit_code"] == 0 and s["state"] == "done"
        assert s["stdin_digest"] == hashlib.sha256(b"input").hexdigest()
        assert s["digest_before"] != s["digest_after"]  # the step wrote a file
        assert steps[1]["digest_before"] == steps[1]["digest_after"] == s["digest_after"]
        assert s["duration"] is not None and s["duration"] >= 0
    _assert_clean(node_env, "once")


def test_fncall_rollout_is_journaled_and_replayed(node_env: dict[str, str]) -> None:
    """fncall keeps its writes in memory: no state digest, no snapshot; keys still hold and
    replay re-executes the whole trajectory from the image."""
    with Job.start("fn", ttl=60) as job:
        ro = job.sandbox(IMAGE, "fncall")
        assert ro.exec("echo a >> /tmp/x; cat /tmp/x", key="k1").stdout == b"a\n"
        assert ro.exec("echo a >> /tmp/x; cat /tmp/x", key="k1").stdout == b"a\n"
        ro.exec("echo b >> /tmp/x", key="k2")
        steps = ro.journal()
        assert [s["key"] for s in steps] == ["k1", "k2"]
        assert steps[0]["digest_before"] is None and steps[0]["digest_after"] is None
        old = ro.sandbox_id
        ro.replay()
        assert ro.sandbox_id != old
        assert ro.exec(["cat", "/tmp/x"]).stdout == b"a\nb\n"
    _assert_clean(node_env, "fn")


def test_trainer_killed_at_random_resumes_every_rollout(node_env: dict[str, str]) -> None:
    """100 rounds of 8 rollouts, the trainer SIGKILLed at random moments: every rollout ends
    with each keyed step applied once, in the state an uninterrupted run reaches."""
    rounds, width = 100, 8
    rng = random.Random(11)
    with Job.start("ref", ttl=300, snapshot_every=0, snapshot_interval=0) as ref:
        solo = ref.sandbox(IMAGE, "container")
        for rnd in range(rounds):
            solo.exec(f"echo r{rnd} >> /root/log", key=f"r{rnd}")
        want = solo.journal(output=False)[-1]["digest_after"]
    job = Job.start("killed", ttl=300, snapshot_every=25, heartbeat=False)
    group = job.group(width, IMAGE, "container")
    assert [m.status for m in group.members] == ["ok"] * width
    env = {**os.environ, **node_env, "PYTHONPATH": str(REPO)}
    kills = 0
    for _ in range(40):
        p = subprocess.Popen([sys.executable, str(TRAINER), "killed", str(rounds), str(width)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith(b"ready"), (line, p.stderr.read() if p.stderr else b"")
        if kills < 12:
            time.sleep(rng.uniform(0.05, 1.5))
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                kills += 1
        out, err = p.communicate(timeout=300)
        if p.returncode == 0:
            assert out.rstrip().endswith(b"done"), (out, err)
            break
        assert p.returncode == -signal.SIGKILL, (p.returncode, out, err)
    else:
        pytest.fail("the trainer never finished")
    assert kills >= 1
    resumed = Job.resume("killed", heartbeat=False)
    rollouts = resumed.rollouts()
    assert len(rollouts) == width
    expected = "".join(f"r{i}\n" for i in range(rounds)).encode()
    for ro in rollouts:
        steps = ro.journal(output=False)
        assert [s["key"] for s in steps] == [f"r{i}" for i in range(rounds)]
        assert all(s["state"] == "done" and s["exit_code"] == 0 for s in steps)
        assert steps[-1]["digest_after"] == want
        assert ro.read_file("/root/log") == expected
    resumed.remove()
    job.close()
    _assert_clean(node_env, "killed")


def test_replay_rebuilds_a_lost_sandbox_from_its_snapshot(node_env: dict[str, str]) -> None:
    with Job.start("replay", ttl=60, snapshot_every=3) as job:
        ro = job.sandbox(IMAGE, "container")
        for i in range(4):
            ro.exec(f"echo {i} >> /root/w", key=f"s{i}")
        ro.write_file("/root/data", b"payload", key="write")
        info = ro.info()
        assert info["snapshot_step"] == 3 and info["snapshot_image"]
        before = ro.journal(output=False)
        old = ro.sandbox_id
        assert old
        _node(node_env).remove(old)  # the sandbox is lost
        _jobs(node_env).sweep()
        assert ro.info()["status"] == "lost"
        with pytest.raises(SandboxError):
            ro.exec("true")
        ro.replay()
        assert ro.sandbox_id != old and ro.info()["alive"]
        assert ro.read_file("/root/w") == b"0\n1\n2\n3\n"
        assert ro.read_file("/root/data") == b"payload"
        assert ro.journal(output=False) == before  # results served from the journal
        again = ro.exec("echo 0 >> /root/w", key="s0")  # keyed: still not run again
        assert again.exit_code == 0 and ro.read_file("/root/w") == b"0\n1\n2\n3\n"
    _assert_clean(node_env, "replay")
    with Job.start("diverge", ttl=60, snapshot_every=0, snapshot_interval=0) as job:
        # a step whose effect differs when re-run: replay refuses to go on past it
        ro = job.sandbox(IMAGE, "container")
        ro.exec("echo same > /root/same", key="same")
        ro.exec("head -c 16 /dev/urandom > /root/random", key="rand")
        with pytest.raises(SandboxError, match="diverged after step 2"):
            ro.replay()
        assert ro.info()["status"] == "lost" and ro.sandbox_id is None
    _assert_clean(node_env, "diverge")


def test_resume_returns_live_sandboxes_and_thaws_a_dead_snapshot(
        node_env: dict[str, str]) -> None:
    code = ("import os, sys\nfrom dsec_cli.api.jobs import Job\n"
            "job = Job.start('resume', ttl=60, heartbeat=False)\n"
            "g = job.group(2, sys.argv[1], 'container')\n"
            "for m in g.members: m.rollout.exec('echo a > /root/a', key='k')\n"
            "m = g.members[0].rollout\n"
            "job._jobs.node.pause(m.sandbox_id)\n"  # as a snapshot would, then dies
            "job._jobs.node.db.update(m.sandbox_id, status='running')\n"
            "os._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code, IMAGE], check=True, env=env, timeout=300)
    job = Job.resume("resume")
    rollouts = job.rollouts()
    assert len(rollouts) == 2
    for ro in rollouts:
        assert [s["key"] for s in ro.journal()] == ["k"]
        assert ro.exec("cat /root/a", timeout=60).stdout == b"a\n"  # thawed: it answers
    job.remove()
    _assert_clean(node_env, "resume")


def test_group_reports_a_member_that_could_not_be_made(node_env: dict[str, str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_cli.run.node import Node

    real = Node.create
    calls: list[int] = []

    def create(self, image, opts=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:  # one member's create fails as a node fault would
            raise SandboxError("injected: runc failed")
        return real(self, image, opts)

    monkeypatch.setattr(Node, "create", create)
    with Job.start("group", ttl=60, max_concurrent=3) as job:
        g = job.group(4, IMAGE, "fncall")
        g.wait(timeout=120)  # the failed member's slot went to the queued one
        assert sorted(m.status for m in g.members) == ["infra_failure", "ok", "ok", "ok"]
        bad = g.failed()
        assert len(bad) == 1 and "injected" in (bad[0].error or "")
        assert bad[0].to_dict()["status"] == "infra_failure"
        assert all(m.seconds is not None and m.seconds > 0 for m in g.members)
        for m in g.ok():
            assert m.rollout is not None
            assert m.rollout.exec(["echo", str(m.index)]).stdout == f"{m.index}\n".encode()
        assert job.info()["held"] == 3
    _assert_clean(node_env, "group")


def test_prewarm_thaws_a_parked_job_in_the_background(node_env: dict[str, str]) -> None:
    from dsec_cli.run.node import Node

    with Job.start("prewarm", ttl=60) as job:
        g = job.group(3, IMAGE, "fncall")
        sids = {m.rollout.sandbox_id for m in g.ok() if m.rollout}
        assert len(sids) == 3
        job.park()
        n = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])
        assert {r.status for r in n.db.all() if r.id in sids} == {"parked"}
        fut = job.prewarm()
        assert fut.result(timeout=120)["parked"] is False
        assert {r.status for r in n.db.all() if r.id in sids} == {"running"}
        for m in g.ok():
            assert m.rollout is not None and m.rollout.exec(["true"]).exit_code == 0
    _assert_clean(node_env, "prewarm")


def test_queue_past_the_cap_with_eta(node_env: dict[str, str]) -> None:
    with Job.start("queue", ttl=60, max_concurrent=1) as job:
        first = job.sandbox(IMAGE, "fncall")
        g = job.group(2, IMAGE, "fncall")
        assert [m.status for m in g.members] == ["queued", "queued"]
        info = job.info()
        assert info["held"] == 1 and info["queued"] == 2
        first.release()
        g.members[0].wait(timeout=60)
        assert g.members[0].status == "ok" and g.members[1].status == "queued"
        info = job.info()
        assert info["queued"] == 1 and info["queue_eta"] is not None
        assert g.members[0].rollout is not None
        g.members[0].rollout.release()
        g.members[1].wait(timeout=60)
        assert g.members[1].ok
    _assert_clean(node_env, "queue")


def test_lease_expiry_parks_then_reclaims_leaving_nothing(node_env: dict[str, str]) -> None:
    """No heartbeat: past the park grace node gc freezes the sandboxes, past the reclaim
    grace it removes them and (retain 0) the job's rows: zero orphans."""
    job = Job.start("lapse", ttl=300, park_grace=1, reclaim_grace=8, retain=0,
                    snapshot_every=2, heartbeat=False)
    g = job.group(2, IMAGE, "container")
    fn = job.sandbox(IMAGE, "fncall")
    for m in g.ok():
        assert m.rollout is not None
        for i in range(3):
            m.rollout.exec(f"echo {i} >> /root/x", key=str(i))
    fn.exec(["true"])
    job.close()
    job.renew(ttl=1)  # the trainer's last heartbeat: the lease lapses in a second
    n = _node(node_env)
    sids = [m.rollout.sandbox_id for m in g.ok() if m.rollout]
    info = job.info()
    _poll("the park grace", lambda: time.time() > info["expires"] + 1.2)
    n.gc()
    assert {r.id: r.status for r in n.db.all() if r.id in sids} == {s: "parked" for s in sids}
    assert job.info()["lease"] == "parked"
    _poll("the reclaim grace", lambda: time.time() > info["expires"] + 8.2)
    report = n.gc()
    assert "lapse" in report["jobs"]["reclaimed"]
    with pytest.raises(NotFoundError):
        job.info()
    _assert_clean(node_env, "lapse")


def test_heartbeat_keeps_the_lease(node_env: dict[str, str]) -> None:
    with Job.start("alive", ttl=1, park_grace=10, reclaim_grace=20) as job:
        ro = job.sandbox(IMAGE, "fncall")
        first = job.info()["expires"]
        _poll("a heartbeat", lambda: job.info()["expires"] > first + 0.5)
        assert job.info()["lease"] == "active"
        _node(node_env).gc()
        assert ro.info()["alive"] and job.info()["parked"] is False
    _assert_clean(node_env, "alive")


def test_cli_job_lifecycle(node_env: dict[str, str]) -> None:
    import json

    from tests.run.conftest import dsec

    dsec(node_env, "job", "start", "cli", "--ttl", "1m", "--max-concurrent", "2")
    out = json.loads(dsec(node_env, "run", "--job", "cli", "--json", IMAGE, "--",
                          "sh", "-c", "echo hi > /root/f; echo done").stdout)
    assert out["result"]["stdout"] == "done\n" and out["status"] == "live"
    sid, rid = out["sandbox"], out["id"]
    assert dsec(node_env, "exec", sid, "--", "cat", "/root/f").stdout == b"hi\n"
    steps = json.loads(dsec(node_env, "journal", rid, "--json").stdout)
    assert [s["argv"][-1] for s in steps] == ["echo hi > /root/f; echo done", "/root/f"]
    table = dsec(node_env, "journal", sid).stdout.decode()
    assert "cat /root/f" in table
    jobs = json.loads(dsec(node_env, "job", "ls", "--json").stdout)
    assert [(j["name"], j["rollouts"], j["held"]) for j in jobs] == [("cli", 1, 1)]
    assert json.loads(dsec(node_env, "job", "park", "cli", "--json").stdout)["parked"]
    assert json.loads(dsec(node_env, "job", "thaw", "cli", "--json").stdout)["parked"] is False
    dsec(node_env, "job", "park", "cli")
    doc = json.loads(dsec(node_env, "job", "thaw", "cli", "--prefetch", "--json").stdout)
    assert doc["parked"] is False
    assert dsec(node_env, "exec", sid, "--", "cat", "/root/f").stdout == b"hi\n"
    doc = json.loads(dsec(node_env, "job", "renew", "cli", "--ttl", "2m", "--json").stdout)
    assert doc["ttl"] == 120
    rebuilt = json.loads(dsec(node_env, "replay", rid, "--json").stdout)
    assert rebuilt["sandbox"] != sid and rebuilt["alive"]
    assert dsec(node_env, "exec", rebuilt["sandbox"], "--", "cat", "/root/f").stdout == b"hi\n"
    assert dsec(node_env, "job", "start", "Bad Name", check=2).returncode == 2
    assert dsec(node_env, "job", "start", "cli", check=2).returncode == 2  # exists
    assert dsec(node_env, "journal", "nosuch", check=2).returncode == 2
    assert dsec(node_env, "job", "start", "x", "--ttl", "-1s", check=2).returncode == 2
    dsec(node_env, "job", "rm", "cli")
    assert json.loads(dsec(node_env, "job", "ls", "--json").stdout) == []
    _assert_clean(node_env, "cli")


def _kill_mid_step(node_env: dict[str, str], cmd: str, ready: str) -> None:
    """A trainer starts keyed step ``k`` running ``cmd`` and is SIGKILLed once ``ready``
    (a shell test inside the sandbox) holds."""
    code = ("import sys\nfrom dsec_cli.api.jobs import Job\n"
            "job = Job.attach('midstep', heartbeat=False)\n"
            "job.rollouts()[0].exec(sys.argv[1], key='k')\n")
    env = {**os.environ, **node_env, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", code, cmd], env=env)
    jobs = _jobs(node_env)
    ro = jobs.rollouts("midstep")[0]

    def started() -> bool:
        if not jobs.db.q("SELECT 1 FROM steps WHERE key='k' AND state='running'"):
            return False
        return _node(node_env).exec(ro["sandbox"], ["/bin/sh", "-c", ready]).exit_code == 0

    try:
        _poll("the step to start", started)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()


def test_interrupted_keyed_step_never_runs_twice(node_env: dict[str, str]) -> None:
    with Job.start("midstep", ttl=60, snapshot_every=0, snapshot_interval=0) as job:
        ro = job.sandbox(IMAGE, "container")
        ro.exec("echo base > /root/base", key="base")
        # killed before the command changed anything: run again in the same sandbox
        _kill_mid_step(node_env, "sleep 600; echo x >> /root/f",
                       "ps | grep -q \"[s]leep 600\"")
        sid = ro.sandbox_id
        res = job.rollouts()[0].exec("echo x >> /root/f", key="k")
        assert res.exit_code == 0
        assert job.rollouts()[0].sandbox_id == sid
        assert ro.read_file("/root/f") == b"x\n"
    with Job.start("midstep", ttl=60, snapshot_every=0, snapshot_interval=0) as job:
        ro = job.sandbox(IMAGE, "container")
        ro.exec("echo base > /root/base", key="base")
        # killed after the command wrote: the rollout is rebuilt to its last committed step
        # and the step runs once there
        _kill_mid_step(node_env, "echo x >> /root/f; sleep 600", "test -s /root/f")
        sid = ro.sandbox_id
        again = job.rollouts()[0]
        assert again.exec("echo x >> /root/f; echo ran", key="k").stdout == b"ran\n"
        assert again.sandbox_id != sid
        assert again.read_file("/root/f") == b"x\n"
        assert again.read_file("/root/base") == b"base\n"
        assert [s["key"] for s in again.journal()] == ["base", "k"]
    _assert_clean(node_env, "midstep")
