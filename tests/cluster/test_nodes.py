"""`dsec node add|ls|check|rm` against real sshd nodes; bad input exits 2 and changes nothing;
a wrong host key is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION

from .sshnodes import SshCluster

DSEC = str(Path(sys.executable).with_name("dsec"))


def _config(home: Path) -> dict:  # type: ignore[type-arg]
    p = home / "config" / "dsec" / "config.yaml"
    return yaml.safe_load(p.read_text()) if p.is_file() else {}


def _add(run_dsec, c: SshCluster, name: str, address: str, *extra: str, check=True):  # type: ignore[no-untyped-def]
    return run_dsec("node", "add", name, address, "--identity", str(c.identity),
                    "--known-hosts", str(c.known_hosts), "--dsec", DSEC, *extra, check=check,
                    env=c.client_env())


def test_add_ls_check_rm(cluster: SshCluster, run_dsec, dsec_home: Path) -> None:  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    out = _add(run_dsec, cluster, "a", n1.address, "--labels", "zone=x,gpu=0")
    assert "added a" in out.stdout
    _add(run_dsec, cluster, "b", n2.address)
    cfg = _config(dsec_home)["nodes"]
    assert cfg["a"]["address"] == n1.address and cfg["a"]["labels"] == {"zone": "x", "gpu": "0"}
    ls = json.loads(run_dsec("node", "ls", "--json", env=cluster.client_env()).stdout)
    assert [r["node"] for r in ls] == ["a", "b"]
    for r in ls:
        assert r["ok"] and r["result"]["protocol"] == PROTOCOL_VERSION
        assert r["result"]["capacity"]["sandboxes"] in (20, 40)
        assert r["result"]["usage"]["sandboxes"] == 0 and "cache_bytes" in r["result"]
    run_dsec("node", "check", "a", env=cluster.client_env())
    # the same node twice is refused, and the config keeps the first
    dup = _add(run_dsec, cluster, "a", n2.address, check=2)
    assert "already exists" in dup.stderr
    run_dsec("node", "rm", "a", env=cluster.client_env())
    assert list(_config(dsec_home)["nodes"]) == ["b"]
    p = run_dsec("node", "rm", "a", check=2, env=cluster.client_env())
    assert "'a'" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert list(_config(dsec_home)["nodes"]) == ["b"]


def test_bad_input_exits_2_and_saves_nothing(cluster: SshCluster, run_dsec,  # type: ignore[no-untyped-def]
                                             dsec_home: Path) -> None:
    n1 = cluster.nodes[0]
    for addr, what in [("127.0.0.1", "USER@HOST"), ("root@", "bad host"),
                       ("root@host:99999", "port"), ("root@bad_host!", "bad host"),
                       ("root@host:", "port")]:
        p = _add(run_dsec, cluster, "x", addr, check=2)
        assert "malformed node address" in p.stderr and what in p.stderr, p.stderr
    assert "invalid node name" in _add(run_dsec, cluster, "auto", n1.address, check=2).stderr
    assert "invalid node name" in _add(run_dsec, cluster, "a/b", n1.address, check=2).stderr
    p = run_dsec("node", "add", "x", n1.address, "--identity", "/nonexistent/key", check=2)
    assert "identity key" in p.stderr
    assert "invalid label" in _add(run_dsec, cluster, "x", n1.address, "--labels", "novalue",
                                   check=2).stderr
    assert _config(dsec_home).get("nodes") in (None, {})
    # unknown nodes, in every command that names one
    for args in (["node", "check", "nope"], ["run", "--node", "nope", "-d", "busybox@1.35-1"],
                 ["exec", "nope/abc", "--", "true"], ["ps", "--node", "nope"],
                 ["rm", "nope/abc"], ["cp", "./x", "nope/abc:/x"]):
        p = run_dsec(*args, check=2, env=cluster.client_env())
        assert "unknown node 'nope'" in p.stderr, (args, p.stderr)
    p = run_dsec("run", "--node", "auto", "-d", "busybox@1.35-1", check=2)
    assert "needs nodes" in p.stderr


def test_wrong_host_key_is_refused(cluster: SshCluster, run_dsec, dsec_home: Path,  # type: ignore[no-untyped-def]
                                   tmp_path: Path) -> None:
    n1, n2 = cluster.nodes[:2]
    # a known_hosts file that claims node1's address has node2's key
    bad = tmp_path / "known_hosts"
    bad.write_text(n2.known_hosts_line().replace(f":{n2.port}]", f":{n1.port}]") + "\n")
    p = run_dsec("node", "add", "evil", n1.address, "--identity", str(cluster.identity),
                 "--known-hosts", str(bad), "--dsec", DSEC, check=1, env=cluster.client_env())
    assert "refused by SSH" in p.stderr and "host key" in p.stderr.lower(), p.stderr
    # an empty known_hosts: an unknown key is not trusted either
    empty = tmp_path / "empty_known_hosts"
    empty.touch()
    p = run_dsec("node", "add", "evil", n1.address, "--identity", str(cluster.identity),
                 "--known-hosts", str(empty), "--dsec", DSEC, check=1, env=cluster.client_env())
    assert "refused by SSH" in p.stderr
    assert empty.read_text() == ""  # nothing learned on first use
    assert _config(dsec_home).get("nodes") in (None, {})


def test_node_without_dsec_is_reported(cluster: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    p = run_dsec("node", "add", "x", cluster.nodes[0].address, "--identity",
                 str(cluster.identity), "--known-hosts", str(cluster.known_hosts),
                 "--dsec", "/nonexistent/dsec", check=1, env=cluster.client_env())
    assert "not installed" in p.stderr, p.stderr


def test_bootstrap_installs_dsec_without_network(cluster: SshCluster, run_dsec,  # type: ignore[no-untyped-def]
                                                 dsec_home: Path, tmp_path: Path) -> None:
    inst = tmp_path / "node-install"
    out = json.loads(run_dsec(
        "node", "add", "fresh", cluster.nodes[0].address, "--identity", str(cluster.identity),
        "--known-hosts", str(cluster.known_hosts), "--bootstrap", "--install-dir", str(inst),
        "--json", env=cluster.client_env()).stdout)
    assert out["dsec"] == f"{inst}/bin/dsec" and out["info"]["protocol"] == PROTOCOL_VERSION
    assert (inst / "site" / "dsec_cli" / "run" / "cluster" / "node_service.py").is_file()
    p = run_dsec("run", "--node", "fresh", "-b", "fncall", "busybox@1.35-1", "--", "echo", "hi",
                 env=cluster.client_env())
    assert p.stdout == "hi\n"


def test_agent_that_never_greets_fails_within_the_read_timeout(  # type: ignore[no-untyped-def]
        cluster: SshCluster, run_dsec, tmp_path: Path) -> None:
    """sshd answers, but the command it runs never writes the protocol's first line: the
    wait for it is bounded by the read timeout, and the message names the node."""
    import time

    silent = tmp_path / "silent-dsec"
    silent.write_text("#!/bin/sh\nexec sleep 30\n")
    silent.chmod(0o755)
    env = {**cluster.client_env(), "DSEC_CONNECT_TIMEOUT": "5s", "DSEC_READ_TIMEOUT": "2s"}
    t0 = time.monotonic()
    p = run_dsec("node", "add", "mute", cluster.nodes[0].address, "--identity",
                 str(cluster.identity), "--known-hosts", str(cluster.known_hosts),
                 "--dsec", str(silent), check=1, env=env)
    took = time.monotonic() - t0
    err = " ".join(p.stderr.split())  # rich wraps long lines
    assert "did not answer the protocol greeting within 2s" in err, err
    assert cluster.nodes[0].address in err
    assert took < 15, f"took {took:.1f}s"
