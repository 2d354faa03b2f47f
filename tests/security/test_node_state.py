"""A cluster node is hostile to another, and another local user to this one: a parked VM's
state that moves between nodes is data the target checks (never an argv, a path or an
option there), and a VM's run dir (QMP and agent sockets, pidfile) is private to this user.

The hostile source is played by crafted input at the target's own entry points: the tar
stream its receiving end reads (`migrate.receive`, also through `dsec node receive-moved`),
the exported document its import reads (`Node.park_import`), and a real move between two
nodes with a tampered export (slow: one microvm boot). The planted run dirs and sockets are
made under a runtime dir of the test's own (``DSEC_RUNTIME_DIR``). Every canary file is in
the test's tmp_path; a wall that is missing lets a probe write only there.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.backends.base import Limits, RootfsSpec, SandboxHandle, SandboxSpec
from dsec_cli.backends.vm import qemuproc
from dsec_cli.backends.vm.qemu import MicroVMBackend
from dsec_cli.backends.vm.qemu_qmp import QMPError, qmp
from dsec_cli.backends.vm.qemuproc import default_state, find_qemu
from dsec_cli.core.errors import ConfigError, SandboxError, UsageError
from dsec_cli.core.rundir import UnsafePathError, runtime_dir
from dsec_cli.run import migrate
from dsec_cli.run.node import CreateOptions, Node
from tests.run.conftest import IMAGE, dsec

from ._sandboxes import *  # noqa: F403 - the sandbox fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="VM state and sandboxes need root")

CANARY = b"the canary's own bytes\n"
OTHER_UID = 65534
DISK = 16 << 20  # the smallest disk a VM takes: the moved disk's size must match its record


@pytest.fixture(autouse=True)
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime root of this test's own (short: socket paths must fit 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-rt-"))
    monkeypatch.setenv("DSEC_RUNTIME_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    p = tmp_path / "canary"
    p.write_bytes(CANARY)
    return p


def _untouched(canary: Path) -> None:
    st = os.lstat(canary)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert canary.read_bytes() == CANARY


def _sid() -> str:
    return os.urandom(6).hex()


# -- the tar stream the target receives --------------------------------------------------------
def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "",
            size: int | None = None) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, link, 0o644
    ti.size = len(data) if size is None else size
    if kind == tarfile.CHRTYPE:
        ti.devmajor, ti.devminor = 1, 3
    return ti, data


def _stream(*members: tuple[tarfile.TarInfo, bytes], end: bool = True) -> bytes:
    """A tar stream of these members, written header by header (a hostile sender's sizes
    need not match its data)."""
    out = io.BytesIO()
    for ti, data in members:
        declared = ti.size
        out.write(ti.tobuf(tarfile.GNU_FORMAT))
        if ti.type in tarfile.REGULAR_TYPES and data:
            out.write(data)
            if len(data) == declared:
                out.write(b"\0" * (-len(data) % 512))
    if end:
        out.write(b"\0" * 1024)
    return out.getvalue()


def _good_members() -> list[tuple[tarfile.TarInfo, bytes]]:
    return [_member("park.state", b"QEVM" + b"\0" * 60), _member("x.erofs", b"erofs")]


def _good_stream(disk: int = DISK) -> bytes:
    """What an honest source sends (a sparse disk of ``disk`` bytes, written by GNU tar)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "park.state").write_bytes(b"QEVM" + b"\0" * 60)
        (Path(d) / "x.erofs").write_bytes(b"erofs")
        with open(Path(d) / "disk.ext4", "wb") as f:
            f.truncate(disk)
        import subprocess

        return subprocess.run(["tar", "-cSf", "-", "-C", d, "park.state", "disk.ext4",
                               "x.erofs"], capture_output=True, check=True).stdout


def _hostile_cases(canary: Path) -> dict[str, tuple[bytes, str]]:
    argv = json.dumps({"argv": ["qemu-system-x86_64", "-pidfile", str(canary),
                                "-drive", f"file={canary},format=raw"]}).encode()
    good = _good_members()
    return {
        "saved argv": (_stream(*good, _member("park.json", argv)), "park.json"),
        "dotdot": (_stream(_member("../escaped", b"x"), *good), "../escaped"),
        "absolute": (_stream(_member(str(canary), b"overwritten"), *good), str(canary)),
        "nested": (_stream(_member("a/park.state", b"x"), *good), "a/park.state"),
        "symlink": (_stream(_member("disk.ext4", kind=tarfile.SYMTYPE, link=str(canary)),
                            *good), "is a link"),
        "hardlink": (_stream(_member("disk.ext4", kind=tarfile.LNKTYPE, link=str(canary)),
                             *good), "is a link"),
        "device": (_stream(_member("disk.ext4", kind=tarfile.CHRTYPE), *good), "a device"),
        "fifo": (_stream(_member("disk.ext4", kind=tarfile.FIFOTYPE), *good), "a FIFO"),
        "directory": (_stream(_member("disk.ext4", kind=tarfile.DIRTYPE),
                              _member("disk.ext4/x", b"x"), *good), "a directory"),
        "twice": (_stream(*good, _member("park.state", b"again")), "twice"),
        "two roots": (_stream(*good, _member("y.erofs", b"other")), "twice"),
        "huge state": (_stream(_member("park.state", size=1 << 60), end=False),
                       "more than this node's memory"),
        "short data": (_stream(_member("park.state", b"x" * 100, size=1 << 20)),
                       "park.state"),
        "not tar": (b"\x7fELF" + os.urandom(2048), "not a valid tar stream"),
        "missing": (_stream(*good), "lack disk.ext4"),
    }


CASES = list(_hostile_cases(Path("/x")))


@pytest.mark.parametrize("case", CASES)
def test_moved_stream_is_refused_unless_plain_expected_files(node: Node, canary: Path,
                                                              case: str) -> None:
    stream, named = _hostile_cases(canary)[case]
    sid = _sid()
    inc = Path(node.park_incoming(sid))
    try:
        with pytest.raises(UsageError) as e:
            migrate.receive(node, sid, io.BytesIO(stream))
        assert named in e.value.message
        _untouched(canary)
        assert os.listdir(inc) == []  # nothing half-written is left to import
        assert not (inc.parent / "escaped").exists() and not (inc / "a").exists()
        with pytest.raises(UsageError, match="lacks"):
            node.park_import(_exported(sid))
        assert node.db.get(sid) is None and not (node.sandboxes_dir / sid).exists()
    finally:
        shutil.rmtree(inc, ignore_errors=True)


def test_moved_stream_through_the_receiving_command(node: Node, node_env: dict[str, str],
                                                    canary: Path) -> None:
    """The command a remote target runs (`dsec node receive-moved ID` over SSH): exit 2, the
    member named, no traceback; an honest stream is taken whole and sparse."""
    stream, _ = _hostile_cases(canary)["symlink"]
    sid = _sid()
    inc = Path(node.park_incoming(sid))
    try:
        p = dsec(node_env, "node", "receive-moved", sid, input=stream, check=2, timeout=60)
        assert b"disk.ext4" in p.stderr and b"link" in p.stderr
        assert b"Traceback" not in p.stderr
        assert os.listdir(inc) == []
        _untouched(canary)
        dsec(node_env, "node", "receive-moved", sid, input=_good_stream(), timeout=60)
        assert sorted(os.listdir(inc)) == ["disk.ext4", "park.state", "root.erofs"]
        disk = os.stat(inc / "disk.ext4")
        assert disk.st_size == DISK and disk.st_blocks * 512 < DISK // 4
    finally:
        shutil.rmtree(inc, ignore_errors=True)


def test_source_files_that_are_links_do_not_move(node: Node, tmp_path: Path,
                                                 canary: Path) -> None:
    """The client's copy (source `tar -c`, target `receive`): a source whose disk is a
    symlink to a file of the target host is refused; the file is not read or written."""
    src = tmp_path / "source"
    src.mkdir()
    (src / "park.state").write_bytes(b"QEVM")
    (src / "x.erofs").write_bytes(b"erofs")
    (src / "disk.ext4").symlink_to(canary)
    sid = _sid()
    inc = Path(node.park_incoming(sid))
    try:
        with pytest.raises(UsageError, match="is a link"):
            migrate.copy_files(object(), node, {"dir": str(src), "root_dir": str(src),
                                                "root_name": "x.erofs"}, sid)
        assert os.listdir(inc) == []
        _untouched(canary)
    finally:
        shutil.rmtree(inc, ignore_errors=True)


# -- the exported document the target imports -------------------------------------------------
def _exported(sid: str, canary: Path | None = None, **handle: Any) -> dict[str, Any]:
    """A source's export of sandbox ``sid``; with ``canary``, every path of its handle
    names it (what a hostile source would choose)."""
    h: dict[str, Any] = {"machine": "microvm", "network": "none", "env": {"A": "b"},
                         "workdir": "/root", "accel": "tcg"}
    if canary is not None:
        bad = str(canary)
        h.update(run_dir=str(canary.parent), pidfile=bad, qmp=bad, agent_sock=bad,
                 state_dir=str(canary.parent), console=bad, disk=bad, snap_mount=bad,
                 root_image=bad, cgroup="../../../escaped", pid=1, start_time=1)
    h.update(handle)
    return {"record": {"id": sid, "backend": "microvm", "image": IMAGE,
                       "image_digest": "0" * 64,
                       "spec": {"limits": {"cpus": 1, "memory": 256 << 20, "disk": DISK},
                                "network": "none", "env": {}, "workdir": "/"},
                       "created": 1.0, "expires": None},
            "handle": h, "dir": "/somewhere", "root_dir": "/else", "root_name": "x.erofs"}


def _received(node: Node) -> str:
    sid = _sid()
    node.park_incoming(sid)
    migrate.receive(node, sid, io.BytesIO(_good_stream()))
    return sid


def _paths_in(argv: list[str]) -> list[str]:
    """Every host path in a QEMU command line (the kernel's own command line aside)."""
    out = []
    for prev, a in zip(["", *argv[:-1]], argv, strict=True):
        if prev != "-append":
            out += re.findall(r"(?:^|[=:,])(/[^,]+)", a)
    return out


def test_the_targets_argv_is_built_from_its_own_config(node: Node, canary: Path,
                                                       runtime: Path) -> None:
    sid = _received(node)
    try:
        rec = node.park_import(_exported(sid, canary))
        state = rec.handle
        assert state is not None
        sdir = node.sandboxes_dir / sid
        assert str(canary) not in json.dumps(state)
        assert state["cgroup"] == f"{node.cgroup_parent}/{sid}"
        assert state["run_dir"] == str(runtime / "vm" / sid)
        assert state["state_dir"] == str(sdir) and state["root_image"] == str(sdir / "root.erofs")
        b = node.backend("microvm")
        argv = b.parked_argv(sid, state)  # what thaw runs, with -S -incoming added
        assert argv[0] == shutil.which("qemu-system-x86_64")
        assert str(canary) not in " ".join(argv)
        own = (str(sdir) + "/", str(runtime / "vm" / sid) + "/", str(b.vm_dir) + "/")
        assert all(p.startswith(own) for p in _paths_in(argv[1:])), _paths_in(argv[1:])
        assert argv[argv.index("-pidfile") + 1] == str(runtime / "vm" / sid / "qemu.pid")
        assert argv[argv.index("-m") + 1] == "256M"  # the record's memory, checked
        assert argv[argv.index("-accel") + 1] == b.acceleration()["accel"]  # this node's
        assert "-incoming" not in argv
        _untouched(canary)
    finally:
        node.remove(sid)
    assert not (node.sandboxes_dir / sid).exists()


BAD_EXPORTS: dict[str, tuple[dict[str, Any], str]] = {
    "argv key": ({"handle": {"argv": ["qemu", "-pidfile", "/x"]}}, "unknown keys: argv"),
    "egress": ({"handle": {"egress": {"netns": "x"}}}, "unknown keys: egress"),
    "other machine": ({"handle": {"machine": "vm"}}, "not microvm"),
    "allowlist": ({"handle": {"network": "allowlist"}}, "cannot move"),
    "env": ({"handle": {"env": {"A": 1}}}, "env"),
    "workdir": ({"handle": {"workdir": "../x"}}, "workdir"),
    "user": ({"handle": {"user": {"uid": "0; x", "gid": 0, "groups": []}}}, "user"),
    "record key": ({"record": {"argv": []}}, "unknown keys"),
    "spec key": ({"spec": {"qemu_args": ["-pidfile"]}}, "unknown keys"),
    "memory text": ({"limits": {"memory": "1G -pidfile /x"}}, "memory"),
    "memory small": ({"limits": {"memory": 1}}, "--memory"),
    "cpus": ({"limits": {"cpus": 1e9}}, "--cpus"),
    "disk size": ({"limits": {"disk": DISK * 2}}, "disk limit"),
    "spec network": ({"spec": {"network": "allowlist"}}, "cannot move"),
    "digests": ({"spec": {"layer_digests": ["../../x"]}}, "sha256"),
    "root name": ({"root_name": "-x.erofs"}, "root image name"),
}


def _bad_export(sid: str, change: dict[str, Any]) -> dict[str, Any]:
    doc = _exported(sid)
    rec, spec = doc["record"], doc["record"]["spec"]
    doc["handle"].update(change.get("handle", {}))
    rec.update(change.get("record", {}))
    spec.update(change.get("spec", {}))
    spec["limits"].update(change.get("limits", {}))
    if "root_name" in change:
        doc["root_name"] = change["root_name"]
    return doc


@pytest.mark.parametrize("case", list(BAD_EXPORTS))
def test_a_malformed_export_is_refused_and_leaves_the_node_unchanged(node: Node,
                                                                     case: str) -> None:
    change, named = BAD_EXPORTS[case]
    before = {r.id for r in node.db.all()}
    sid = _received(node)
    try:
        with pytest.raises(UsageError) as e:
            node.park_import(_bad_export(sid, change))
        assert named in e.value.message, e.value.message
        assert {r.id for r in node.db.all()} == before
        assert not (node.sandboxes_dir / sid).exists()
    finally:
        shutil.rmtree(node.root / migrate.INCOMING / sid, ignore_errors=True)


# -- the VM run dir ------------------------------------------------------------------------------
def _plant(runtime: Path, sid: str, how: str, tmp_path: Path) -> Path:
    d = runtime_dir("vm") / sid
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        d.symlink_to(tmp_path / "elsewhere")
    else:
        d.mkdir()
        if how == "other owner":
            os.chown(d, OTHER_UID, OTHER_UID)
        else:
            os.chmod(d, 0o777)
    return d


def _contents(d: Path) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("how", ["other owner", "world-writable", "symlink"])
def test_a_planted_run_dir_is_refused_by_create_and_thaw(runtime: Path, tmp_path: Path,
                                                         how: str) -> None:
    sid = _sid()
    sdir = tmp_path / "sandbox"
    st = default_state(sid, str(sdir))
    assert st["run_dir"] == str(runtime / "vm" / sid)  # under the private runtime dir
    planted = _plant(runtime, sid, how, tmp_path)
    before = os.lstat(planted)
    b = MicroVMBackend(tmp_path / "node", boot="cold")
    layer = tmp_path / "layer"
    layer.mkdir()
    spec = SandboxSpec(sandbox_id=sid, rootfs=RootfsSpec((layer,), sdir / "u", sdir / "w"),
                       state_dir=sdir, limits=Limits(memory=256 << 20))
    with pytest.raises(UnsafePathError, match=str(planted)):
        b.create(spec)
    # a parked sandbox's thaw: refused before QEMU is started with a pidfile there
    sdir.mkdir(exist_ok=True)
    (sdir / "park.state").write_bytes(b"QEVM")
    handle = SandboxHandle(sid, "microvm", {**st, "machine": "microvm", "accel": "tcg",
                                            "root_image": str(sdir / "root.erofs"),
                                            "cgroup": f"dsec-test/{sid}"})
    with pytest.raises(UnsafePathError, match=str(planted)):
        b.thaw(handle, lambda _: None)
    after = os.lstat(planted)
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)  # left as it was
    target = tmp_path / "elsewhere" if how == "symlink" else planted
    assert _contents(target) == []  # no pidfile, no socket written there
    assert find_qemu(sid) is None


def test_run_dir_sockets_must_fit_a_unix_address(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("DSEC_RUNTIME_DIR", str(deep))
    with pytest.raises(ConfigError, match="DSEC_RUNTIME_DIR"):
        qemuproc.make_run_dir(default_state("a" * 64, None))


@pytest.mark.parametrize("how", ["world-writable dir", "other owner"])
def test_qmp_and_agent_sockets_not_ours_are_not_connected_to(runtime: Path, tmp_path: Path,
                                                             how: str) -> None:
    sid = _sid()
    d = runtime_dir("vm") / sid
    d.mkdir(mode=0o700)
    socks = {}
    for name in ("qmp.sock", "agent.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / name))
        s.listen(4)
        s.setblocking(False)
        socks[name] = s
        if how == "other owner":
            os.lchown(d / name, OTHER_UID, OTHER_UID)
    if how == "world-writable dir":
        os.chmod(d, 0o777)
    try:
        st = default_state(sid, str(tmp_path))
        with pytest.raises(QMPError, match="not a socket this user made"):
            qmp(st["qmp"], "quit", timeout=2)
        b = MicroVMBackend(tmp_path / "node", boot="cold")
        handle = SandboxHandle(sid, "microvm", {**st, "pid": os.getpid()})
        with pytest.raises(SandboxError, match="not one this user made"):
            b._ping_within(handle, 2)
        for s in socks.values():  # nobody connected to either
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in socks.values():
            s.close()


# -- a real move with a tampered export ---------------------------------------------------------
class _Tampering:
    """A source node whose export names the canary in every path of the handle, and whose
    sandbox dir holds a saved QEMU command line aimed at it."""

    def __init__(self, node: Node, canary: Path) -> None:
        self.node, self.canary = node, canary

    def park_export(self, sid: str) -> dict[str, Any]:
        doc = self.node.park_export(sid)
        bad = _exported(sid, self.canary)["handle"]
        doc["handle"] = {**doc["handle"], **{k: bad[k] for k in bad if k not in
                                             ("machine", "accel", "env", "workdir")}}
        return doc

    def remove(self, sid: str) -> None:
        self.node.remove(sid)


def _plant_argv(sdir: Path, canary: Path) -> None:
    (sdir / "park.json").write_text(json.dumps({"argv": [
        "qemu-system-x86_64", "-pidfile", str(canary), "-serial", f"file:{canary}"]}))


def _cmdline(sid: str) -> str:
    pid = find_qemu(sid)
    assert pid is not None
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.slow
def test_a_tampered_move_thaws_under_the_targets_own_command_line(
        node: Node, store_url: str, tmp_path: Path, canary: Path, runtime: Path) -> None:
    target = Node(tmp_path / "target", store_url)
    rec = node.create(IMAGE, CreateOptions(backend="microvm", memory=256 << 20))
    sid = rec.id
    try:
        assert node.exec(sid, ["sh", "-c", "echo kept > /root/kept"]).exit_code == 0
        node.park(sid)
        _plant_argv(node.sandboxes_dir / sid, canary)
        out = migrate.move(_Tampering(node, canary), target, sid)
        assert out["status"] == "running"
        line = _cmdline(sid)
        assert str(canary) not in line and str(target.sandboxes_dir / sid) in line
        assert f"-pidfile {runtime}/vm/{sid}/qemu.pid" in line
        assert target.exec(sid, ["cat", "/root/kept"]).stdout == b"kept\n"
        # a park and thaw here: the saved command line a source left is never read
        target.park(sid)
        _plant_argv(target.sandboxes_dir / sid, canary)
        target.thaw(sid)
        assert str(canary) not in _cmdline(sid)
        assert target.exec(sid, ["cat", "/root/kept"]).stdout == b"kept\n"
        _untouched(canary)
    finally:
        for n in (target, node):
            try:
                n.remove(sid)
            except UsageError:
                pass
    assert find_qemu(sid) is None
