"""Warm pools on a real node (runc): a member taken by a create shows nothing of the sandbox
before it, the pool refills in the background, node gc reclaims members nobody takes,
admission counts each member once, and a refill killed with SIGKILL leaves nothing after
reconcile."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsec_cli.run.node import CreateOptions, Node
from dsec_cli.run.pool import PoolSettings, learned_size

from .conftest import IMAGE, dsec, leaks

REPO = Path(__file__).resolve().parents[2]
OPTS = dict(memory=64 << 20, pids=64, env={"POOLTEST": "1"})


def wait_for(what: str, cond: Callable[[], bool], deadline: float = 90.0) -> None:
    end = time.monotonic() + deadline
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def pnode(node_env: dict[str, str]) -> Iterator[Node]:
    """A Node of its own (its own refill thread), drained and stopped at the end."""
    n = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])
    try:
        yield n
    finally:
        n.close()
        n.pools.drain()
        for r in n.db.all():
            n.remove(r.id)
        n.reconcile()
        assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def ready_ids(n: Node) -> set[str]:
    return {r.id for m in n.pools.members().values() for r in m["pooled"]}


def test_a_pool_member_shows_nothing_of_the_sandbox_before_it(pnode: Node) -> None:
    st = pnode.pools.set(IMAGE, CreateOptions(**OPTS), 2)  # type: ignore[arg-type]
    assert (st["size"], st["ready"]) == (2, 2)
    pnode.pools.stop()  # no refill: the next two creates must take the two members made
    members = ready_ids(pnode)
    a = pnode.create(IMAGE, CreateOptions(**OPTS, ttl=600))  # type: ignore[arg-type]
    assert a.id in members and a.status == "running" and a.image == IMAGE
    assert a.expires is not None and a.id in {r.id for r in pnode.sandboxes()}
    secret = "s3cr3t-" + os.urandom(4).hex()
    r = pnode.exec(a.id, ["/bin/sh", "-c",
                          f"echo {secret} > /root/secret; echo {secret} > /tmp/t; "
                          f"mkdir -p /dev/shm && echo {secret} > /dev/shm/s; "
                          f"echo 'export LEAK={secret}' >> /etc/profile; "
                          f"hostname h-{secret[-8:]} 2>/dev/null; "
                          f"LEAK={secret} nohup sleep 1000 >/dev/null 2>&1 & echo started"],
                   timeout=30)
    assert r.exit_code == 0 and r.stdout.strip() == b"started"
    hostname_a = pnode.exec(a.id, ["hostname"]).stdout
    pnode.remove(a.id)

    b = pnode.create(IMAGE, CreateOptions(**OPTS))  # type: ignore[arg-type]
    assert b.id in members and b.id != a.id and b.expires is None
    r = pnode.exec(b.id, ["/bin/sh", "-c",
                          "cat /root/secret /tmp/t /dev/shm/s /etc/profile 2>/dev/null; "
                          "env; cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | "
                          "tr '\\0' '\\n'; ps; ls -a /root /tmp"], timeout=30)
    assert r.exit_code == 0
    assert secret.encode() not in r.stdout + r.stderr
    assert b"sleep 1000" not in r.stdout and b"POOLTEST=1" in r.stdout
    # its own hostname (the image's), its own limits, applied as for a fresh sandbox
    assert pnode.exec(b.id, ["hostname"]).stdout != hostname_a or b"h-" not in hostname_a
    info = pnode.describe(b.id)
    assert info["limits"]["memory"] == 64 << 20 and info["limits"]["pids"] == 64
    from dsec_cli.backends import _cgroups

    cg = _cgroups.Cgroup(f"{pnode.cgroup_parent}/{b.id}")
    mem, pids = cg.path("memory"), cg.path("pids")
    assert mem is not None and pids is not None
    limit = "memory.max" if cg.layout.version == 2 else "memory.limit_in_bytes"
    assert int((mem / limit).read_text()) == 64 << 20
    assert (pids / "pids.max").read_text().strip() == "64"
    pnode.remove(b.id)
    # a create with other options is not served by the pool
    c = pnode.create(IMAGE, CreateOptions(memory=32 << 20))
    assert c.id not in members
    pnode.remove(c.id)


def test_a_take_reads_the_ref_now_and_matches_members_by_digest(
        pnode: Node, node_env: dict[str, str]) -> None:
    """A create takes a member by the manifest digest its reference names at that moment:
    another name for the same digest takes it (and the sandbox bears the name asked for), a
    name removed from the store fails as it would without a pool and takes nothing."""
    from dsec_cli.core.errors import NotFoundError
    from dsec_cli.format.refs import delete_ref, resolve, set_ref
    from dsec_cli.push.stores import open_store

    st = pnode.pools.set(IMAGE, CreateOptions(**OPTS), 2)  # type: ignore[arg-type]
    assert st["ready"] == 2 and st["budget_members"] == (2 << 30) // (64 << 20)
    pnode.pools.stop()
    members = ready_ids(pnode)
    store = open_store(node_env["DSEC_STORE"])
    digest = resolve(store, IMAGE)
    set_ref(store, "pooltest", "alias", digest)
    try:
        a = pnode.create("pooltest@alias", CreateOptions(**OPTS))  # type: ignore[arg-type]
        assert a.id in members and a.image == "pooltest@alias" and a.image_digest == digest
        delete_ref(store, "pooltest@alias")
        with pytest.raises(NotFoundError):
            pnode.create("pooltest@alias", CreateOptions(**OPTS))  # type: ignore[arg-type]
        assert ready_ids(pnode) == members - {a.id}
        # a create asking for a lazy mount is made now, never served by a member
        assert not pnode._poolable(CreateOptions(**OPTS, fetch="lazy"))  # type: ignore[arg-type]
        pnode.remove(a.id)
    finally:
        with contextlib.suppress(NotFoundError):
            delete_ref(store, "pooltest@alias")


def test_the_pool_refills_in_the_background(pnode: Node) -> None:
    pnode.pools.set(IMAGE, CreateOptions(**OPTS), 1)  # type: ignore[arg-type]
    first = ready_ids(pnode)
    a = pnode.create(IMAGE, CreateOptions(**OPTS))  # type: ignore[arg-type]
    assert a.id in first
    wait_for("the refill", lambda: len(ready_ids(pnode) - first) == 1)
    b = pnode.create(IMAGE, CreateOptions(**OPTS))  # type: ignore[arg-type]
    assert b.id in ready_ids(pnode) | {b.id} and b.id not in first
    for sid in (a.id, b.id):
        pnode.remove(sid)
    # ps never lists members; drain removes them
    wait_for("the second refill", lambda: len(ready_ids(pnode)) == 1)
    assert not {r.id for r in pnode.sandboxes()} & ready_ids(pnode)
    assert len(pnode.pools.drain()) == 1 and not ready_ids(pnode)


def test_learned_pools_and_gc_reclaim(node_env: dict[str, str], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("pool: {auto: true, window: 1h, idle: 1h, max: 3}\n")
    monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    n = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])
    try:
        made = [n.create(IMAGE, CreateOptions(pids=50)) for _ in range(3)]
        [st] = n.pools.status()
        assert st["size"] == "auto" and 2 <= st["target"] <= 3  # 3 creates, at most 2 windows
        wait_for("the learned pool", lambda: n.pools.status()[0]["ready"] == st["target"])
        for r in made:
            n.remove(r.id)
        n.close()  # its refill thread would make them again
        # the same node once the key has been idle longer than `idle`: size 0, gc reclaims
        cfg.write_text("pool: {auto: true, window: 1h, idle: 1s, max: 3}\n")
        idle = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])
        time.sleep(1.5)
        assert idle.pools.status()[0]["target"] == 0
        report = idle.gc()
        assert len(report["pool_reclaimed"]) == st["target"] and not ready_ids(idle)
    finally:
        n.close()
        n.pools.drain()
        for r in n.db.all():
            n.remove(r.id)
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_gc_recycles_members_past_max_age(pnode: Node, node_env: dict[str, str],
                                          tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pnode.pools.set(IMAGE, CreateOptions(pids=40), 2)
    old = ready_ids(pnode)
    cfg = tmp_path / "config.yaml"
    cfg.write_text("pool: {max_age: 1s}\n")
    monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    aged = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])
    time.sleep(1.5)
    assert sorted(aged.gc()["pool_reclaimed"]) == sorted(old)
    assert not ready_ids(aged)


def test_admission_counts_a_member_once(pnode: Node) -> None:
    from dsec_cli.run.cluster.errors import CapacityError
    from dsec_cli.run.cluster.node_service import NodeService
    from dsec_cli.run.cluster.protocol import to_wire

    (pnode.root / "capacity.yaml").write_text("sandboxes: 2\n")
    try:
        svc = NodeService(pnode)
        pnode.pools.set(IMAGE, CreateOptions(pids=30), 2)
        pnode.pools.stop()  # keep the count still while it is checked
        assert svc.admission.usage().sandboxes == 2  # the node is full of members
        opts = to_wire(CreateOptions(pids=30))
        rec = svc.create({"image": IMAGE, "opts": opts}, lambda ev: None)
        assert svc.admission.usage().sandboxes == 2  # one member became the sandbox
        with pytest.raises(CapacityError):  # no member for these options: no room
            svc.create({"image": IMAGE, "opts": to_wire(CreateOptions(pids=31))},
                       lambda ev: None)
        pnode.remove(rec["id"])
    finally:
        (pnode.root / "capacity.yaml").unlink()


def test_kill_9_mid_refill_leaves_nothing_after_reconcile(node_env: dict[str, str]) -> None:
    env = {**os.environ, **node_env, "DSEC_DEBUG_DELAY_POOL_REFILL": "120",
           "PYTHONPATH": str(REPO)}
    code = ("from dsec_cli.run.node import Node, CreateOptions; import sys; "
            "n = Node(); n.pools.set(sys.argv[1], CreateOptions(pids=33), 1)")
    p = subprocess.Popen([sys.executable, "-c", code, IMAGE], env=env)
    n = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])
    try:
        def made() -> bool:  # the member's container runs; its row still says creating
            rows = [r for r in n.db.all() if r.status == "creating"]
            return bool(rows) and (n.sandboxes_dir / rows[0].id / "pid").is_file()

        wait_for("a member being made", made)
        [row] = [r for r in n.db.all() if r.status == "creating"]
        pid = int((n.sandboxes_dir / row.id / "pid").read_text())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        report = n.reconcile()
        assert report["aborted"] == [row.id]
        assert n.db.all() == []
        assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}
        wait_for("the member's processes to go", lambda: not Path(f"/proc/{pid}").exists())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        n.pools.drain()
        n.reconcile()


def test_pool_command(node_env: dict[str, str]) -> None:
    out = json.loads(dsec(node_env, "pool", "set", IMAGE, "--size", "1", "--pids", "44",
                          "--json").stdout)
    assert (out["size"], out["ready"], out["limits"]["pids"]) == (1, 1, 44)
    ls = json.loads(dsec(node_env, "pool", "ls", "--json").stdout)
    assert [p["key"] for p in ls["pools"]] == [out["key"]] and ls["settings"]["auto"] is False
    # a create with the same options takes the member (and this short process refills
    # the pool before it exits)
    sid = dsec(node_env, "run", "-d", "--pids", "44", IMAGE).stdout.decode().strip()
    ps = json.loads(dsec(node_env, "ps", "--json").stdout)
    assert [s["id"] for s in ps] == [sid]
    dsec(node_env, "rm", sid)
    # a pool of learned size: empty until a matching create, then sized by it
    auto = json.loads(dsec(node_env, "pool", "set", IMAGE, "--pids", "45", "--json").stdout)
    assert (auto["size"], auto["target"], auto["ready"]) == ("auto", 0, 0)
    sid = dsec(node_env, "run", "-d", "--pids", "45", IMAGE).stdout.decode().strip()

    def pools_now() -> dict[str, dict[str, object]]:
        return {p["key"]: p for p in json.loads(dsec(node_env, "pool", "ls", "--json").stdout)
                ["pools"]}

    # the member is made by the CLI process before it exits, or by the command server that
    # ran the create before it answers
    wait_for("both pools refilled", lambda: [(p["target"], p["ready"])
                                             for p in pools_now().values()] == [(1, 1), (1, 1)])
    assert pools_now()[auto["key"]]["size"] == "auto"
    dsec(node_env, "rm", sid)
    assert len(json.loads(dsec(node_env, "pool", "drain", "--json").stdout)["removed"]) == 2
    assert json.loads(dsec(node_env, "pool", "ls", "--json").stdout)["pools"] == []
    # a size the memory budget cannot hold is said so (the pool holds what fits)
    big = dsec(node_env, "pool", "set", IMAGE, "--size", "40", "--memory", "64M", "--no-fill",
               "--json")
    assert b"memory budget holds 32" in big.stderr
    assert json.loads(dsec(node_env, "pool", "set", IMAGE, "--size", "0", "--memory", "64M",
                           "--json").stdout)["ready"] == 0
    dsec(node_env, "pool", "drain")
    assert json.loads(dsec(node_env, "pool", "ls", "--json").stdout)["pools"] == []
    for bad in (["set", IMAGE, "--size", "-1"], ["set", IMAGE, "--size", "many"],
                ["set", IMAGE, "--memory", "1"], ["drain", "nosuchpool"]):
        p = dsec(node_env, "pool", *bad, check=2)
        assert b"Traceback" not in p.stderr
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_learned_size_and_settings() -> None:
    s = PoolSettings(window=10, idle=100, max=4)
    assert learned_size([], 1000, s) == 0
    assert learned_size([991, 992, 993, 1001], 1005, s) == 3  # the largest window
    assert learned_size([800, 801, 802], 1000, s) == 0  # all older than idle
    assert learned_size([float(t) for t in range(990, 1000)], 1000, s) == 4  # at most max
    from dsec_cli.core.errors import ConfigError

    for bad in ({"auto": "yes"}, {"max": -1}, {"memory": "lots"}, {"idle": "0s"},
                {"nosuch": 1}):
        with pytest.raises(ConfigError):
            PoolSettings.parse(bad)
    assert PoolSettings.parse({"memory": "1G", "idle": "5m"}).idle == 300


def test_a_row_read_alone_keeps_its_layer_order(tmp_path: Path) -> None:
    """Reading one sandbox row (a take, a lookup) reads only its leases, in the order of its
    layer stack, as reading every row does."""
    from dsec_cli.run.state import NodeDB, SandboxRecord

    db = NodeDB(tmp_path / "node.db")
    stack = ["/c/zz-bottom", "/c/aa-middle", "/c/mm-top"]
    for sid in ("one", "two"):
        db.insert(SandboxRecord(sid, "container", "img", "d", "running", None, {}, 1.0, None,
                                layers=[f"{p}-{sid}" for p in stack]), [])
    assert db.get("one").layers == [f"{p}-one" for p in stack]  # type: ignore[union-attr]
    assert [r.layers for r in db.all()] == [[f"{p}-{s}" for p in stack] for s in ("one", "two")]
