"""exec, cp, snapshot, pause and rm through the node named in the sandbox id (the real CLI
over SSH), and a node that stops or hangs: reported and skipped, never waited on."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from .conftest import IMAGE
from .sshnodes import SshCluster


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # a session that ended meanwhile
            pass


def test_exec_cp_snapshot_rm_through_the_right_node(client: SshCluster, run_dsec,  # type: ignore[no-untyped-def]
                                                    tmp_path: Path) -> None:
    sid = run_dsec("run", "--node", "node2", "-d", IMAGE).stdout.strip()
    assert sid.startswith("node2/")
    try:
        p = run_dsec("exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7", check=7)
        assert p.stdout == "out\n" and p.stderr == "err\n"
        src = tmp_path / "in.txt"
        src.write_bytes(b"hello from the client\n")
        os.chmod(src, 0o640)
        run_dsec("cp", str(src), f"{sid}:/srv/in.txt")
        assert run_dsec("exec", sid, "--", "cat", "/srv/in.txt").stdout == \
            "hello from the client\n"
        run_dsec("exec", sid, "--", "sh", "-c", "echo made-on-node2 > /srv/made.txt")
        run_dsec("cp", f"{sid}:/srv/made.txt", str(tmp_path))
        assert (tmp_path / "made.txt").read_text() == "made-on-node2\n"
        doc = json.loads(run_dsec("inspect", sid, "--json").stdout)
        assert doc["id"] == sid and doc["node"] == "node2" and doc["status"] == "running"
        ps = json.loads(run_dsec("ps", "--node", "node2", "--json").stdout)
        assert sid in [r["id"] for r in ps]
        assert sid not in [r["id"] for r in
                           json.loads(run_dsec("ps", "--node", "node1", "--json").stdout)]
        run_dsec("pause", sid)
        assert "paused" in run_dsec("exec", sid, "--", "true", check=2).stderr
        run_dsec("resume", sid)
        snap = json.loads(run_dsec("snapshot", sid, "--as", "snapped@1", "--json").stdout)
        assert snap["sandbox"] == sid and snap["image"] == "snapped@1"
    finally:
        run_dsec("rm", sid)
    assert "no sandbox" in run_dsec("exec", sid, "--", "true", check=2).stderr
    # the snapshot went to the shared store: another node runs it
    p = run_dsec("run", "--node", "node3", "snapped@1", "--", "cat", "/srv/in.txt", "/srv/made.txt")
    assert p.stdout == "hello from the client\nmade-on-node2\n"


def test_stopped_node_is_reported_and_others_keep_working(client: SshCluster, run_dsec,  # type: ignore[no-untyped-def]
                                                          monkeypatch) -> None:
    from dsec_cli.core.config import save_user_config

    node4 = client.add_node(f"node4-{os.getpid()}", client.root / "data")
    client.nodes.remove(node4)  # owned by this test
    try:
        cfg = {**client.config_nodes(), "node4": {**client.config_nodes()["node1"],
                                                  "address": node4.address}}
        save_user_config({"nodes": cfg})
        env = {"DSEC_NODE_TIMEOUT": "8", "DSEC_SSH_TIMEOUT": "3"}
        sid4 = run_dsec("run", "--node", "node4", "-b", "fncall", "-d", IMAGE, env=env).stdout
        sid1 = run_dsec("run", "--node", "node1", "-b", "fncall", "-d", IMAGE, env=env).stdout
        node4.stop()
        p = run_dsec("ps", "--all-nodes", check=1, env=env)
        assert sid1.strip() in p.stdout and "node node4 unreachable, skipped" in p.stderr
        p = run_dsec("exec", sid4.strip(), "--", "true", check=1, env=env)
        assert "node4 (" in p.stderr and "unreachable" in p.stderr, p.stderr
        ls = json.loads(run_dsec("node", "ls", "--json", env=env).stdout)
        state = {r["node"]: (r["ok"], r.get("unreachable")) for r in ls}
        assert state["node4"] == (False, True) and state["node1"] == (True, None)
        # placement skips it and still places
        sid = run_dsec("run", "--node", "auto", "-b", "fncall", "-d", IMAGE, env=env).stdout
        assert not sid.startswith("node4/")
        run_dsec("rm", sid.strip(), sid1.strip(), env=env)
        gc = json.loads(run_dsec("gc", "--all-nodes", "--json", check=1, env=env).stdout)
        assert {r["node"]: r["ok"] for r in gc["nodes"]} == {
            "node1": True, "node2": True, "node3": True, "node4": False}
        # a node that accepts connections but never answers (frozen) is bounded too
        node4.start()
        from .sshnodes import descendants

        frozen = [node4.proc.pid, *descendants(node4.proc.pid)]  # type: ignore[union-attr]
        _signal(frozen, signal.SIGSTOP)
        p = run_dsec("ps", "--all-nodes", check=1, env=env)
        assert "node node4 unreachable, skipped" in p.stderr
        _signal(frozen, signal.SIGCONT)
    finally:
        node4.stop()
        client.cleanup_node(node4)


def test_node_id_prefixes(client: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    """NODE/PREFIX addresses a sandbox on that node as a local prefix does; a prefix no
    sandbox of that node has is named in the error."""
    sid = run_dsec("run", "--node", "node1", "-d", IMAGE).stdout.strip()
    try:
        node, local = sid.split("/")
        assert node == "node1" and len(local) >= 8
        p = run_dsec("exec", f"node1/{local[:6]}", "--", "echo", "by prefix")
        assert p.stdout == "by prefix\n"
        other = ("0" if local[0] != "0" else "1") + local[1:6]
        p = run_dsec("exec", f"node1/{other}", "--", "true", check=2)
        assert other in p.stderr, p.stderr
        # the same prefix on another node is not this sandbox
        p = run_dsec("exec", f"node2/{local[:6]}", "--", "true", check=2)
        assert local[:6] in p.stderr, p.stderr
        assert run_dsec("rm", f"node1/{local[:6]}").stdout.strip() == sid
    finally:
        run_dsec("rm", sid, check=False)
def test_class_park_thaw_top_through_the_node(client: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    sid = run_dsec("run", "--node", "node1", "-d", "--class", "latency", "--memory", "64M",
                   IMAGE).stdout.strip()
    try:
        run_dsec("exec", sid, "--", "sh", "-c", "echo before > /root/f")
        doc = json.loads(run_dsec("park", sid, "--json").stdout)
        assert doc["id"] == sid and doc["status"] == "parked"
        assert {"resident", "reclaimed", "swapped"} <= set(doc)
        assert "dsec thaw" in run_dsec("exec", sid, "--", "true", check=2).stderr
        assert json.loads(run_dsec("thaw", sid, "--json").stdout)["status"] == "running"
        warm = json.loads(run_dsec("thaw", sid, "--prefetch", "--json").stdout)
        assert warm["id"] == sid and warm["status"] == "running" and "prefetched" in warm
        assert run_dsec("exec", sid, "--", "cat", "/root/f").stdout == "before\n"
        top = json.loads(run_dsec("top", "--node", "node1", "--json", "--interval",
                                  "0.1").stdout)
        row = [r for r in top if r["id"] == sid][0]
        assert row["class"] == "latency" and row["node"] == "node1"
        assert row["declared_memory"] == 64 << 20 and row["resident"] > 0
        ps = json.loads(run_dsec("ps", "--node", "node1", "--json").stdout)
        use = [r for r in ps if r["id"] == sid][0]["usage"]
        assert use["class"] == "latency" and use["resident"] > 0
        nodes = json.loads(run_dsec("node", "ls", "--json").stdout)
        info = [n for n in nodes if n["node"] == "node1"][0]["result"]
        assert info["usage"]["resident"] > 0 and info["usage"]["latency_cpus"] == 0
        assert info["capacity"]["cpu_overcommit"] == 1.0
        assert "cgroup_controllers" in info["density"]
    finally:
        run_dsec("rm", sid)
