"""Snapshot boot (vm_boot: snapshot) against real QEMU guests: two sandboxes restored from
one saved boot share nothing (files, processes, random numbers, boot id) and each gets its own
hostname and limits; a create killed with SIGKILL while it builds the saved boot leaves
nothing once its sandbox is torn down as reconcile does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsec_cli.backends import ExecRequest, Limits, RootfsSpec, SandboxHandle, SandboxSpec
from dsec_cli.backends.vm import vmsnap
from dsec_cli.backends.vm.qemu import MicroVMBackend, VMBackend
from dsec_cli.backends.vm.qemuproc import default_state

pytestmark = pytest.mark.slow

PIDS = 40
DIGEST = "sha256:" + "c" * 64


def spec_for(sid: str, layer: Path, node: Path, memory: int, hostname: str = "sandbox"
             ) -> SandboxSpec:
    sdir = node / "sandboxes" / sid
    return SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec((layer,), sdir / "upper", sdir / "work"),
                       state_dir=sdir, env={"GREETING": "hi"}, workdir="/root",
                       limits=Limits(memory=memory, pids=PIDS), image_digest=DIGEST,
                       hostname=hostname)


def sh(b: MicroVMBackend | VMBackend, h: SandboxHandle, cmd: str) -> str:
    r = b.exec(h, ExecRequest(["sh", "-c", cmd], timeout=60))
    assert r.exit_code == 0, r
    return r.stdout.decode()


def test_restored_sandboxes_share_nothing(base_layer: Path, node_dir: Path) -> None:
    b = MicroVMBackend(node_dir, boot="snapshot")
    mem = 320 << 20
    a = b.create(spec_for(f"ra{os.getpid()}", base_layer, node_dir, mem, "first"))
    try:
        assert a.state.get("restored")  # restored, not booted
        secret = "s3cr3t-" + os.urandom(4).hex()
        sh(b, a, f"echo {secret} > /root/secret; echo {secret} > /tmp/t; "
                 f"echo {secret} > /dev/shm/s; nohup sleep 1000 {secret} >/dev/null 2>&1 &")
        ident_a = sh(b, a, "hostname; cat /proc/sys/kernel/random/boot_id; "
                           "head -c 32 /dev/urandom | od -An -tx1")
    finally:
        b.destroy(a)
    c = b.create(spec_for(f"rb{os.getpid()}", base_layer, node_dir, mem, "second"))
    try:
        assert c.state.get("restored") == a.state["restored"]  # the same saved boot
        seen = sh(b, c, "cat /root/secret /tmp/t /dev/shm/s 2>/dev/null; ps; "
                        "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; ls -a /root /tmp; echo $GREETING")
        assert secret not in seen and "sleep 1000" not in seen and seen.endswith("hi\n")
        ident_c = sh(b, c, "hostname; cat /proc/sys/kernel/random/boot_id; "
                           "head -c 32 /dev/urandom | od -An -tx1")
        host_a, boot_a, rand_a = ident_a.split("\n", 2)
        host_c, boot_c, rand_c = ident_c.split("\n", 2)
        assert (host_a, host_c) == ("first", "second")
        assert boot_a != boot_c and rand_a != rand_c
        # the sandbox's own limits
        r = b.exec(c, ExecRequest(["sh", "-c", f"for i in $(seq {PIDS + 10}); do sleep 1 & "
                                               "done; wait"], timeout=60))
        assert b"can't fork" in r.stderr or b"Resource temporarily unavailable" in r.stderr
        total = int(sh(b, c, "grep MemTotal /proc/meminfo").split()[1]) << 10
        assert mem // 2 < total <= mem
        assert not list(Path("/tmp").glob(f"dsec-vm-ra{os.getpid()}*"))
    finally:
        b.destroy(c)
    assert not Path(c.state["disk"]).exists() and not Path(c.state["run_dir"]).exists()


def test_q35_restores_with_its_own_identity(base_layer: Path, node_dir: Path) -> None:
    """The vm (q35) backend restores too (started without the kernel, as microvm is), and its
    first request (the agent's identity request) leaves nothing in the guest."""
    b = VMBackend(node_dir, boot="snapshot")
    h = b.create(spec_for(f"rq{os.getpid()}", base_layer, node_dir, 256 << 20, "third"))
    try:
        assert h.state.get("restored")
        assert sh(b, h, "hostname; ls -a /dev/shm") == "third\n.\n..\n"
    finally:
        b.destroy(h)
    assert not Path(h.state["disk"]).exists() and not Path(h.state["run_dir"]).exists()


def test_restore_answered_only_on_a_later_connection(base_layer: Path, node_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """When the first connection's identity request gets no answer in time (here: a wait far
    shorter than QEMU's load, so several connections are given up on, and their requests may
    still run once the guest does), a later one still gives the sandbox its identity, and
    nothing stays behind in the guest."""
    from dsec_cli.backends.vm import qemu

    monkeypatch.setattr(qemu, "RESTORED_RETRY", 0.02)
    b = MicroVMBackend(node_dir, boot="snapshot")
    mem = 320 << 20  # the saved boot of test_restored_sandboxes_share_nothing
    h = b.create(spec_for(f"rr{os.getpid()}", base_layer, node_dir, mem, "fourth"))
    try:
        assert h.state.get("restored")
        assert sh(b, h, "hostname; ls -a /dev/shm") == "fourth\n.\n..\n"
    finally:
        b.destroy(h)


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from dsec_cli.backends.vm.qemu import MicroVMBackend, VMBackend
    from tests.backends.vm.test_snapboot import spec_for
    b = MicroVMBackend(Path({node!r}), boot="snapshot")
    b.create(spec_for({sid!r}, Path({layer!r}), Path({node!r}), {mem}))
""")


def test_kill_9_while_the_saved_boot_is_built_leaves_nothing(base_layer: Path,
                                                             node_dir: Path) -> None:
    sid = f"rk{os.getpid()}"
    mem = 352 << 20  # a key no other test has built
    repo = str(Path(__file__).resolve().parents[3])
    code = CHILD.format(repo=repo, node=str(node_dir), sid=sid, layer=str(base_layer), mem=mem)
    child = subprocess.Popen([sys.executable, "-c", code])
    pidfile = Path(default_state(f"{sid}-tpl", None)["pidfile"])
    try:
        deadline = time.monotonic() + 120
        while not pidfile.is_file() or not pidfile.read_text().strip():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        qemu = int(pidfile.read_text())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert Path(f"/proc/{qemu}").exists()  # the template guest outlived its creator
    sdir = node_dir / "sandboxes" / sid
    # what reconcile does for a create whose owner died: destroy with what it can derive
    b = MicroVMBackend(node_dir, boot="snapshot")
    b.destroy(SandboxHandle(sid, "microvm", {"state_dir": str(sdir)}))
    assert not Path(f"/proc/{qemu}").exists() or b"dsec-" not in Path(
        f"/proc/{qemu}/cmdline").read_bytes()
    assert not list(Path(default_state(sid, None)["run_dir"]).parent.glob(f"{sid}*"))
    shutil.rmtree(sdir, ignore_errors=True)  # what the node does after the backend's destroy
    # the half-built template went with the sandbox, and none was ever published half-saved
    templates = node_dir / "vm" / "templates"
    assert not vmsnap.build_dir(node_dir / "vm", sid).exists()
    assert all(vmsnap.ready(p) for p in templates.iterdir() if not p.name.startswith("."))
    assert str(node_dir) not in Path("/proc/mounts").read_text()


def test_gc_prunes_only_saved_boots_left_unused(tmp_path: Path) -> None:
    root = tmp_path / "templates"
    for name in ("old", "new"):
        (root / name).mkdir(parents=True)
        (root / name / "state").write_bytes(b"x")
    (root / ".old.lock").write_bytes(b"")
    week_ago = time.time() - 8 * 86400
    os.utime(root / "old", (week_ago, week_ago))
    assert vmsnap.prune(tmp_path, 7 * 86400, dry_run=True) == ["old"]
    assert (root / "old").is_dir()
    assert vmsnap.prune(tmp_path, 7 * 86400) == ["old"]
    assert sorted(p.name for p in root.iterdir()) == [".old.lock", "new"]


def test_root_images_of_one_manifest_digest_are_shared(tmp_path: Path) -> None:
    """A node passes the bare manifest digest: it keys the root image (and so the saved
    boot) whatever the layer directories' timestamps, as the prefixed form does."""
    from dsec_cli.backends.vm import vmimage

    layer = tmp_path / "layer"
    (layer / "bin").mkdir(parents=True)
    hexd = "ab" * 32
    before = vmimage.image_key([layer], hexd)
    os.utime(layer, (1, 1))  # the layer cache marks a use this way
    assert vmimage.image_key([layer], hexd) == before
    assert vmimage.image_key([layer], "sha256:" + hexd) == before
    assert vmimage.image_key([layer], "") != vmimage.image_key([layer / "bin"], "")
