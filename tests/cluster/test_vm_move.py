"""Thaw on another node (run/migrate.py) against real nodes over SSH and a real microvm: a
parked VM moves from node1 to node2 with `dsec thaw ID --to node2`, keeps its id, files,
processes (same pid) and hostname, and nothing of it is left on node1. One guest boot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_cli.backends.vm.qemuproc import find_qemu
from dsec_cli.core.errors import UsageError
from dsec_cli.run.node import CreateOptions

from .conftest import IMAGE
from .sshnodes import SshCluster

pytestmark = pytest.mark.slow


def test_parked_vm_thaws_on_another_node(client: SshCluster) -> None:
    from dsec_cli.api.sandboxes import Sandbox, thaw
    from dsec_cli.run.cluster.registry import get_node

    n1, n2 = get_node("node1"), get_node("node2")
    state1, state2 = (next(n.state_dir for n in client.nodes if n.name == name)
                      for name in ("node1", "node2"))
    # each node says how it parks (dsec node check --json: result.density.park)
    facts = n2.info()["density"]
    assert "state file" in facts["park"]["microvm"] and "usable" in facts["criu"]
    rec = n1.create(IMAGE, CreateOptions(backend="microvm", memory=256 << 20))
    local = rec.id.split("/", 1)[1]
    moved = f"node2/{local}"
    try:
        r = n1.exec(rec.id, ["sh", "-c", "echo moved > /root/f; hostname; "
                                         "sleep 100000 >/dev/null 2>&1 & echo $!"])
        assert r.exit_code == 0, r.stderr
        host, bg = r.stdout.decode().split()
        # only a parked VM moves; a refused move changes nothing
        with pytest.raises(UsageError, match="not parked"):
            thaw(rec.id, to="node2")
        n1.park(rec.id)
        with pytest.raises(UsageError, match="already on node"):
            thaw(rec.id, to="node1")
        p = subprocess.run([sys.executable, "-m", "dsec_cli", "thaw", rec.id, "--to", "node2",
                            "--json"], capture_output=True, text=True, timeout=600,
                           env=os.environ.copy())
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["id"] == moved and out["status"] == "running"
        # nothing of it on node1: no row, no files, no QEMU of node1's
        assert [s.id for s in n1.sandboxes()] == []
        assert not (state1 / "sandboxes" / local).exists()
        pid = find_qemu(local)
        assert pid is not None
        assert str(state2) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not (state2 / "sandboxes" / local / "park.state").exists()
        assert not any((state2 / "incoming").iterdir())
        # the same sandbox: files, processes (same pid), hostname
        r = n2.exec(moved, ["sh", "-c", f"cat /root/f; tr '\\0' ' ' < /proc/{bg}/cmdline; "
                                        "echo; hostname"])
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode() == f"moved\nsleep 100000 \n{host}\n"
        assert n2.lookup(moved).status == "running"
        # and back, through the SDK's Sandbox: the object follows it
        sb = Sandbox._wrap(n2.lookup(moved), n2)
        sb.park()
        sb.thaw(to="node1")
        assert sb.id == rec.id and sb.read_file("/root/f") == b"moved\n"
        assert [s.id for s in n2.sandboxes()] == []
        assert not (state2 / "sandboxes" / local).exists()
        sb.node.remove(sb.id)
    finally:
        for n, sid in ((n2, moved), (n1, rec.id)):
            try:
                n.remove(sid)
            except Exception:
                pass
    assert find_qemu(local) is None
    assert not (state2 / "sandboxes" / local).exists()
