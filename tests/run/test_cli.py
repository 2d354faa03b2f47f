"""Every sandbox command through the real `dsec` script: run, exec, cp, ps, rm, pause,
resume, snapshot, gc --node, and bad input (exit 2, nothing changed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .conftest import IMAGE, dsec, leaks


def test_run_streams_output_and_exit_code(node_env: dict[str, str]) -> None:
    p = dsec(node_env, "run", IMAGE, "--", "sh", "-c", "echo out; echo err >&2; exit 7",
             check=7)
    assert p.stdout == b"out\n" and b"err\n" in p.stderr
    assert json.loads(dsec(node_env, "ps", "--json").stdout) == []


def test_run_json_and_fncall(node_env: dict[str, str]) -> None:
    p = dsec(node_env, "run", IMAGE, "--backend", "fncall", "--json", "--", "cat", "/etc/motd")
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == 0 and doc["stdout"] == "Welcome to a dsec sandbox.\n"


def test_detached_lifecycle(node_env: dict[str, str], tmp_path: Path) -> None:
    p = dsec(node_env, "run", "-d", IMAGE, "--memory", "64M", "--pids", "64")
    sid = p.stdout.decode().strip()
    ps = json.loads(dsec(node_env, "ps", "--json").stdout)
    assert [r["id"] for r in ps] == [sid] and ps[0]["status"] == "running"
    # exec: stdin, env, workdir, exit code
    p = dsec(node_env, "exec", sid, "--env", "A=1", "--workdir", "/etc", "--", "sh", "-c",
             "cat; echo $A; pwd; exit 3", input=b"piped\n", check=3)
    assert p.stdout == b"piped\n1\n/etc\n"
    dsec(node_env, "exec", "--timeout", "0.5", sid, "--", "sleep", "30", check=137)  # killed
    # cp both ways, mode kept
    src = tmp_path / "in.sh"
    src.write_text("#!/bin/sh\necho copied\n")
    src.chmod(0o755)
    dsec(node_env, "cp", str(src), f"{sid}:/root/in.sh")
    assert dsec(node_env, "exec", sid, "/root/in.sh").stdout == b"copied\n"
    dsec(node_env, "cp", f"{sid}:/etc/passwd", str(tmp_path))
    assert (tmp_path / "passwd").read_text().startswith("root:x:0:0")
    # pause / resume
    assert b"paused" in dsec(node_env, "pause", sid).stdout
    p = dsec(node_env, "exec", sid, "true", check=2)
    assert b"paused" in p.stderr
    dsec(node_env, "resume", sid)
    dsec(node_env, "exec", sid, "true")
    assert dsec(node_env, "rm", sid).stdout.decode().strip() == sid
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}


def test_snapshot_round_trip(node_env: dict[str, str], tmp_path: Path) -> None:
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    dsec(node_env, "exec", sid, "--", "sh", "-c",
         "echo new > /root/new.txt; rm /etc/motd; mkdir -p /opt/d && echo x > /opt/d/f")
    remote = (tmp_path / "remote").as_uri()
    out = json.loads(dsec(node_env, "snapshot", sid, "--as", "snaptest@1", "--push", remote,
                          "--json").stdout)
    assert out["image"] == "snaptest@1" and out["layer"] == "snaptest-layer@1"
    assert {r["ref"] for r in out["pushed"]["refs"]} == {"snaptest@1", "snaptest-layer@1"}
    dsec(node_env, "exec", sid, "true")  # still running after the snapshot
    p = dsec(node_env, "run", "snaptest@1", "--", "sh", "-c",
             "cat /root/new.txt /opt/d/f; test -e /etc/motd || echo gone; "
             "cat /etc/passwd | head -1")
    assert p.stdout == b"new\nx\ngone\nroot:x:0:0:root:/root:/bin/sh\n"
    # the pushed image runs from the other store on a fresh node
    other = {**node_env, "DSEC_STORE": remote, "DSEC_STATE_DIR": str(tmp_path / "node2")}
    p = dsec(other, "run", "snaptest@1", "--", "cat", "/root/new.txt")
    assert p.stdout == b"new\n"
    dsec(other, "gc", "--node", "--budget", "0")
    assert leaks(other["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}
    dsec(node_env, "rm", sid)


def test_bad_input_exits_2(node_env: dict[str, str], tmp_path: Path) -> None:
    cases = [
        (["run", "nosuch@1", "--", "true"], b"nosuch@1"),
        (["run", IMAGE, "--memory", "1K", "--", "true"], b"--memory"),
        (["run", IMAGE, "--cpus", "999", "--", "true"], b"--cpus"),
        (["run", IMAGE, "--pids", "0", "--", "true"], b"--pids"),
        (["run", IMAGE, "--memory", "lots", "--", "true"], b"--memory"),
        (["run", IMAGE, "--backend", "nope", "--", "true"], b"backend"),
        (["run", IMAGE, "--network", "bridge", "--", "true"], b"network"),
        (["run", IMAGE], b"-d"),
        (["exec", "deadbeef0000", "true"], b"deadbeef0000"),
        (["rm", "deadbeef0000"], b"deadbeef0000"),
        (["pause", "deadbeef0000"], b"deadbeef0000"),
        (["cp", str(tmp_path / "a"), str(tmp_path / "b")], b"SANDBOX:PATH"),
        (["gc", "--node", "--budget", "lots"], b"--budget"),
    ]
    for args, needle in cases:
        p = dsec(node_env, *args, check=2)
        assert needle in p.stderr, (args, p.stderr)
        assert b"Traceback" not in p.stderr
    assert json.loads(dsec(node_env, "ps", "--json").stdout) == []
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    for args, needle in [
        (["cp", f"{sid}:relative/path", str(tmp_path)], b"absolute"),
        (["cp", f"{sid}:/no/such/file", str(tmp_path)], b"no such file"),
        (["snapshot", sid, "--as", "no-version"], b"NAME@VERSION"),
        (["exec", sid, "--env", "NOEQUALS", "true"], b"KEY=VALUE"),
    ]:
        p = dsec(node_env, *args, check=2)
        assert needle in p.stderr, (args, p.stderr)
    dsec(node_env, "rm", sid)


def test_ttl_expiry_and_node_gc(node_env: dict[str, str]) -> None:
    keep = dsec(node_env, "run", "-d", IMAGE, "--ttl", "1h").stdout.decode().strip()
    gone = dsec(node_env, "run", "-d", IMAGE, "--ttl", "2s").stdout.decode().strip()
    expires = {r["id"]: r["expires"] for r in json.loads(dsec(node_env, "ps", "--json").stdout)}
    assert set(expires) == {keep, gone}
    # no gc, no cron: the node's reaper removes it within seconds of its expiry
    deadline = time.time() + 60
    while gone in expires and time.time() < deadline:
        time.sleep(0.5)
        expires = {r["id"]: r["expires"]
                   for r in json.loads(dsec(node_env, "ps", "--json").stdout)}
    assert list(expires) == [keep], expires
    log = (Path(node_env["DSEC_STATE_DIR"]) / "reaper.log").read_text()
    assert f"removed {gone}: its TTL ran out" in log, log
    assert leaks(node_env["DSEC_STATE_DIR"])["dirs"] == [keep]
    # the layer in use is leased: a zero budget cannot evict it while `keep` runs
    from dsec_cli.run.node import Node

    leased = {Path(p).name for p in Node(node_env["DSEC_STATE_DIR"]).db.leased_layers()}
    rep = json.loads(dsec(node_env, "gc", "--node", "--budget", "0", "--json").stdout)["node"]
    assert leased and not leased & set(rep["evicted"]) and rep["cache_bytes"] > 0
    dsec(node_env, "rm", keep)
    rep = json.loads(dsec(node_env, "gc", "--node", "--budget", "0", "--json").stdout)["node"]
    assert leased <= set(rep["evicted"]) and rep["cache_bytes"] == 0
    dsec(node_env, "run", IMAGE, "--", "true")  # re-materialized on demand
