"""VM park to a state file (backends/vm/vmpark.py) against a real microvm guest: park ends
QEMU and gives its memory back, thaw brings back the same files and the same processes (same
pids), a park or thaw killed midway is recovered by reconcile with nothing left behind, and
rm of a parked VM removes its state file. Two guest boots: one microvm shared by the module,
one q35 `vm`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.backends import _cgroups
from dsec_cli.backends.vm import vmpark
from dsec_cli.backends.vm.qemuproc import default_state, find_qemu, proc_start
from dsec_cli.core.errors import UsageError
from dsec_cli.run.node import CreateOptions, Node
from dsec_cli.run.state import SandboxRecord
from tests.run.conftest import IMAGE, dsec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")]


@pytest.fixture(scope="module")
def vm(node: Node) -> Iterator[SandboxRecord]:
    """One microvm with a file and a background process made before any park."""
    rec = node.create(IMAGE, CreateOptions(backend="microvm", memory=256 << 20))
    try:
        r = node.exec(rec.id, ["sh", "-c", "echo kept > /root/kept; "
                                           "sleep 100000 >/dev/null 2>&1 & echo $!"])
        assert r.exit_code == 0, r.stderr
        rec.spec["bg_pid"] = int(r.stdout.strip())
        yield rec
    finally:
        try:
            node.remove(rec.id)
        except Exception:
            pass


def sdir(node: Node, rec: SandboxRecord) -> Path:
    return node.sandboxes_dir / rec.id


def qemu_pid(node: Node, rec: SandboxRecord) -> int:
    return int(node.lookup(rec.id).handle["pid"])


def alive(pid: int) -> bool:
    return proc_start(pid) is not None


def same_inside(node: Node, rec: SandboxRecord) -> None:
    """The files and processes made before the first park are there, as they were."""
    bg = rec.spec["bg_pid"]
    r = node.exec(rec.id, ["sh", "-c", f"cat /root/kept; tr '\\0' ' ' < /proc/{bg}/cmdline"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode() == "kept\nsleep 100000 "


def empty_group(node: Node, rec: SandboxRecord) -> None:
    """Nothing left in the sandbox's cgroup (an ended QEMU leaves it once reaped)."""
    cg = _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}")
    wait_for(lambda: cg.procs() == [], "the sandbox's cgroup to empty", 60)


def wait_for(cond: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(0.1)


def test_park_ends_qemu_and_thaw_brings_back_files_and_processes(
        node: Node, vm: SandboxRecord, node_env: dict[str, str]) -> None:
    pid = qemu_pid(node, vm)
    assert vmpark.rss(pid) > 0
    out = node.park(vm.id)
    assert out["status"] == "parked" and out["mechanism"] == "qemu-migrate-file"
    assert out["resident_before"] > 0 and out["state_bytes"] > 0
    # QEMU is gone and its memory with it; the guest is in the state file
    assert not alive(pid) and find_qemu(vm.id) is None
    empty_group(node, vm)
    state = sdir(node, vm) / vmpark.STATE
    assert state.stat().st_size == out["state_bytes"]
    # a parked VM is parked, not dead, for reconcile, ps and top
    assert [r.status for r in node.sandboxes() if r.id == vm.id] == ["parked"]
    ps = json.loads(dsec(node_env, "ps", "--json").stdout)
    assert [s["status"] for s in ps if s["id"] == vm.id] == ["parked"]
    top = {u["id"]: u for u in node.top()}
    assert top[vm.id]["parked_to_file"] == out["state_bytes"]
    with pytest.raises(UsageError, match="parked"):
        node.exec(vm.id, ["true"])
    # thawed by one process, the first exec from another
    doc = json.loads(dsec(node_env, "thaw", vm.id, "--json").stdout)
    assert doc["status"] == "running"
    assert dsec(node_env, "exec", vm.id, "--", "cat", "/root/kept").stdout == b"kept\n"
    assert node.lookup(vm.id).status == "running"
    assert not state.exists() and not (sdir(node, vm) / vmpark.ARGV).exists()
    assert qemu_pid(node, vm) != pid and alive(qemu_pid(node, vm))
    assert qemu_pid(node, vm) in _cgroups.Cgroup(f"{node.cgroup_parent}/{vm.id}").procs()
    same_inside(node, vm)
    r = node.exec(vm.id, ["hostname"])
    assert r.exit_code == 0 and r.stdout.strip()


def test_a_park_killed_midway_is_recovered(node: Node, vm: SandboxRecord,
                                           node_env: dict[str, str]) -> None:
    """Killed after QEMU wrote the stream to the temporary file, before the rename: reconcile
    removes the partial file, the sandbox stays parked, thaw resumes the QEMU that kept it."""
    pid = qemu_pid(node, vm)
    tmp = sdir(node, vm) / (vmpark.STATE + ".tmp")
    p = subprocess.Popen([str(Path(os.sys.executable).with_name("dsec")),  # type: ignore[attr-defined]
                          "park", vm.id], env={**os.environ, **node_env,
                                               "DSEC_DEBUG_DELAY_VM_PARK": "600"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: tmp.exists() and node.lookup(vm.id).status == "parked"
                 and _qemu_status(node, vm) == "postmigrate", "the save to finish")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    report = node.reconcile()
    assert vm.id in report.get("park_recovered", [])
    assert not tmp.exists() and not (sdir(node, vm) / vmpark.STATE).exists()
    assert node.lookup(vm.id).status == "parked" and alive(pid)
    node.thaw(vm.id)
    assert qemu_pid(node, vm) == pid
    same_inside(node, vm)


def test_a_thaw_killed_midway_is_recovered(node: Node, vm: SandboxRecord,
                                           node_env: dict[str, str]) -> None:
    """Killed once the new QEMU loaded the guest (stopped) and the row has its pid, before the
    state file went: reconcile ends that QEMU (the guest never ran), the sandbox stays parked
    to its file, and a thaw then works."""
    node.park(vm.id)
    state = sdir(node, vm) / vmpark.STATE
    p = subprocess.Popen([str(Path(os.sys.executable).with_name("dsec")),  # type: ignore[attr-defined]
                          "thaw", vm.id], env={**os.environ, **node_env,
                                               "DSEC_DEBUG_DELAY_VM_THAW": "600"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: find_qemu(vm.id) is not None
                 and node.lookup(vm.id).handle.get("pid") == find_qemu(vm.id)
                 and _qemu_status(node, vm) == "paused", "the thaw to load the guest")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    half = find_qemu(vm.id)
    assert half is not None
    gc = dsec(node_env, "gc", "--node", "--json")  # node gc reconciles first
    assert b"park_recovered" in gc.stdout and vm.id.encode() in gc.stdout
    assert not alive(half) and find_qemu(vm.id) is None
    assert state.is_file() and node.lookup(vm.id).status == "parked"
    empty_group(node, vm)
    node.thaw(vm.id)
    same_inside(node, vm)


def test_rm_of_a_parked_vm_leaves_nothing(node: Node, vm: SandboxRecord) -> None:
    node.park(vm.id)
    assert (sdir(node, vm) / vmpark.STATE).is_file()
    # its unflushed writes are in the saved RAM: a snapshot waits for a thaw
    with pytest.raises(UsageError, match="parked"):
        node.snapshot(vm.id, "parked-snap@1")
    node.remove(vm.id)
    assert not sdir(node, vm).exists() and find_qemu(vm.id) is None
    assert not Path(default_state(vm.id, None)["run_dir"]).exists()
    assert vm.id not in _cgroups.children(node.cgroup_parent)
    assert node.db.get(vm.id) is None


def _qemu_status(node: Node, rec: SandboxRecord) -> str | None:
    from dsec_cli.backends.vm.qemu_qmp import QMPError, qmp

    try:
        return (qmp(node.lookup(rec.id).handle["qmp"], "query-status", timeout=5)
                or {}).get("status")
    except (QMPError, KeyError):
        return None


def test_a_q35_vm_parks_and_thaws_too(node: Node) -> None:
    """The `vm` backend (q35, virtio-pci) goes through the same park and thaw."""
    rec = node.create(IMAGE, CreateOptions(backend="vm", memory=256 << 20))
    try:
        r = node.exec(rec.id, ["sh", "-c", "echo q35 > /root/kept; "
                                           "sleep 100000 >/dev/null 2>&1 & echo $!"])
        assert r.exit_code == 0, r.stderr
        bg = int(r.stdout.strip())
        pid = qemu_pid(node, rec)
        out = node.park(rec.id)
        assert out["state_bytes"] > 0 and not alive(pid) and find_qemu(rec.id) is None
        node.thaw(rec.id)
        r = node.exec(rec.id, ["sh", "-c", f"cat /root/kept; tr '\\0' ' ' < /proc/{bg}/cmdline"])
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode() == "q35\nsleep 100000 "
    finally:
        node.remove(rec.id)
    assert find_qemu(rec.id) is None and not sdir(node, rec).exists()
