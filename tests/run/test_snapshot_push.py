"""A snapshot pushed to another store runs from there, and `dsec inspect` shows sandboxes."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import IMAGE, dsec


def test_snapshot_push_then_run_from_the_other_store(node_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    other = (tmp_path / "other").as_uri()
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    dsec(node_env, "exec", sid, "--", "sh", "-c", "echo pushed > /root/state")
    out = json.loads(dsec(node_env, "snapshot", sid, "--as", "pushed@1", "--push", other,
                          "--json").stdout)
    assert out["image"] == "pushed@1"
    info = json.loads(dsec(node_env, "inspect", sid, "--json").stdout)
    assert info["id"] == sid and info["status"] == "running" and info["backend"] == "container"
    dsec(node_env, "rm", sid)
    listed = {i["ref"] for i in json.loads(dsec(node_env, "ls", "--store", other,
                                                "--json").stdout)}
    assert {"pushed@1", "pushed-layer@1"} <= listed
    p = dsec({**node_env, "DSEC_STORE": other}, "run", "pushed@1", "--", "cat", "/root/state")
    assert p.stdout == b"pushed\n"
    p = dsec(node_env, "inspect", "nosuchbox", check=2)
    assert b"nosuchbox" in p.stderr
