"""Density: CPU classes written to the real cgroup files of container, fncall and VM
sandboxes, admission with overcommit ratios and actual resident memory, park/thaw giving
memory back to swap and keeping files and processes, idle reclaim from node gc, `dsec top`."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.backends import _cgroups
from dsec_cli.core.errors import UsageError
from dsec_cli.run.node import CreateOptions, Node
from tests.run.conftest import IMAGE, dsec, leaks

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def cpu_files(node: Node, sid: str) -> dict[str, int]:
    """The CPU controls of a sandbox's group, read from the kernel's files."""
    rel = f"{node.cgroup_parent}/{sid}"
    cpu = _cgroups.layout().mounts["cpu"] / rel
    out = {}
    for name in ("cpu.shares", "cpu.weight", "cpu.idle"):
        if (cpu / name).exists():
            out[name] = int((cpu / name).read_text())
    return out


def expected(cls: str) -> dict[str, int]:
    shares, weight, idle = _cgroups.CPU_CLASSES[cls]
    v2 = _cgroups.Cgroup("").is_v2("cpu")
    out = {"cpu.weight": weight} if v2 else {"cpu.shares": shares}
    if (_cgroups.layout().mounts["cpu"] / "cpu.idle").exists():
        out["cpu.idle"] = idle
        if idle:  # SCHED_IDLE: the kernel sets (and shows) the group's weight itself
            del out["cpu.weight" if v2 else "cpu.shares"]
    return out


@pytest.fixture
def made(node: Node) -> Iterator[list[str]]:
    """Sandbox ids a test made; all removed at its end."""
    ids: list[str] = []
    yield ids
    for sid in ids:
        try:
            node.remove(sid)
        except Exception:
            pass


SHORT_SLICE = _cgroups.SCHED_CLASSES["latency"][1]


@pytest.mark.parametrize("backend", ["container", "fncall"])
def test_cpu_classes_reach_the_sandbox_cgroup(node: Node, made: list[str], backend: str) -> None:
    for cls in ("latency", "batch", "idle"):
        rec = node.create(IMAGE, CreateOptions(backend=backend, cpu_class=cls))
        made.append(rec.id)
        have = cpu_files(node, rec.id)
        for name, value in expected(cls).items():
            assert have[name] == value, (cls, name, have)
        # every process of the sandbox, and what it starts later, has the class's standing
        # with the host's OOM killer
        want = str(_cgroups.OOM_SCORE_ADJ[cls])
        for pid in _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}").procs():
            assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == want
        r = node.exec(rec.id, ["cat", "/proc/self/oom_score_adj"])  # 300 above the agent
        assert r.stdout.strip() == str(min(1000, int(want) + 300)).encode()
        # and the class's scheduling (policy, EEVDF slice), inherited by commands: read from
        # the host's view of a command's /proc/PID/sched while it runs
        policy, slice_ns = _cgroups.SCHED_CLASSES[cls]
        r = node.exec(rec.id, ["sh", "-c", "cat /proc/$$/sched"])
        sched = dict(line.split(":", 1) for line in r.stdout.decode().splitlines()
                     if line.count(":") == 1)
        sched = {k.strip(): v.strip() for k, v in sched.items()}
        assert int(sched["policy"]) == policy, (cls, sched.get("policy"))
        if slice_ns:
            assert int(sched["se.slice"]) == slice_ns, (cls, sched.get("se.slice"))
        else:
            assert int(sched["se.slice"]) != SHORT_SLICE, (cls, sched.get("se.slice"))
    # the classes are relative: latency outweighs batch, batch outweighs idle
    lat, bat, idl = (cpu_files(node, sid) for sid in made)
    key = "cpu.weight" if "cpu.weight" in lat else "cpu.shares"
    assert lat[key] > bat[key] > idl[key]


def test_bad_cpu_class_is_refused_before_anything_exists(node: Node) -> None:
    before = {r.id for r in node.db.all()}
    with pytest.raises(UsageError, match="--class"):
        node.create(IMAGE, CreateOptions(cpu_class="realtime"))
    assert {r.id for r in node.db.all()} == before
    p = dsec({}, "run", "--class", "fast", IMAGE, "--", "true", check=2)
    assert b"--class" in p.stderr


def test_vm_runs_in_its_own_cgroup_with_its_class_and_parks(node: Node, made: list[str]
                                                           ) -> None:
    rec = node.create(IMAGE, CreateOptions(backend="microvm", cpu_class="idle", memory=256 << 20))
    made.append(rec.id)
    rel = f"{node.cgroup_parent}/{rec.id}"
    pid = rec.handle["pid"]
    assert str(pid) in (_cgroups.layout().mounts["cpu"] / rel / "cgroup.procs").read_text()
    for name, value in expected("idle").items():
        assert cpu_files(node, rec.id)[name] == value
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == \
        str(_cgroups.OOM_SCORE_ADJ["idle"])
    node.put_file(rec.id, "/tmp/kept", b"vm state")
    out = node.park(rec.id)  # QEMU stopped, its memory pushed out
    assert out["status"] == "parked" and node.lookup(rec.id).status == "parked"
    with pytest.raises(UsageError, match="parked"):
        node.exec(rec.id, ["true"])
    node.thaw(rec.id)
    assert node.get_file(rec.id, "/tmp/kept") == b"vm state"
    node.remove(rec.id)
    made.remove(rec.id)
    assert not (_cgroups.layout().mounts["cpu"] / rel).exists()


def hold(node: Node, sid: str, mib: int, source: str) -> None:
    """A process in the sandbox holding ``mib`` MiB of anonymous memory read from
    ``source``: dd fills one block, then blocks writing it to a pipe nobody reads."""
    r = node.exec(sid, ["sh", "-c", f"(dd if={source} bs={mib}M count=1 iflag=fullblock "
                                    "| sleep 100000) >/dev/null 2>&1 &"])
    assert r.exit_code == 0, r.stderr
    want = (mib - 8) << 20
    wait_for(lambda: _cgroups.Cgroup(f"{node.cgroup_parent}/{sid}").memory_use()
             .get("anon", 0) >= want, f"{mib} MiB resident")


def wait_for(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(0.2)


# -- admission ------------------------------------------------------------------------------------
@pytest.fixture
def fresh_node(tmp_path: Path, node_env: dict[str, str]) -> Iterator[Node]:
    n = Node(tmp_path / "state", node_env["DSEC_STORE"])
    yield n
    for r in n.db.all():
        n.remove(r.id)
    assert leaks(str(n.root)) == {"mounts": [], "cgroups": [], "dirs": []}


def test_admission_applies_cpu_overcommit_by_class(fresh_node: Node) -> None:
    from dsec_cli.run.cluster.admission import Admission
    from dsec_cli.run.cluster.errors import CapacityError

    (fresh_node.root / "capacity.yaml").write_text(
        "cpus: 2\ncpu_overcommit: 3\nmemory: 64G\nsandboxes: 100\n")
    adm = Admission(fresh_node)
    held = [adm.reserve(2, None, "batch"), adm.reserve(2, None, "batch"),
            adm.reserve(1.5, None, "latency")]
    # latency CPUs never add up past the node's real CPUs, overcommitted or not
    with pytest.raises(CapacityError, match="latency cpus"):
        adm.reserve(1, None, "latency")
    held.append(adm.reserve(0.5, None, "latency"))
    assert adm.usage().cpus == 6
    with pytest.raises(CapacityError, match="cpus 6"):  # 2 CPUs x 3 are all declared
        adm.reserve(0.5, None, "batch")
    held.append(adm.reserve(2, None, "idle"))  # idle work does not count
    for t in held:
        adm.release(t)
    assert adm.usage().cpus == 0


def test_admission_counts_resident_memory_and_memory_overcommit(fresh_node: Node) -> None:
    from dsec_cli.run.cluster.admission import Admission
    from dsec_cli.run.cluster.errors import CapacityError

    (fresh_node.root / "capacity.yaml").write_text(
        "memory: 400M\nmemory_overcommit: 4\nsandboxes: 100\n")
    adm = Admission(fresh_node)
    t = adm.reserve(None, 1500 << 20)  # declared may reach 4 x 400M
    with pytest.raises(CapacityError, match="memory"):
        adm.reserve(None, 200 << 20)
    adm.release(t)
    rec = fresh_node.create(IMAGE, CreateOptions(memory=512 << 20))
    hold(fresh_node, rec.id, 300, "/dev/zero")
    assert adm.usage().resident >= 292 << 20
    assert adm.usage().memory == 512 << 20
    # declared 512M + 480M fits 1600M, but what the node really holds (300M) does not leave
    # the 120M a new 480M sandbox is expected to hold at a ratio of 4
    with pytest.raises(CapacityError, match="resident memory"):
        adm.reserve(None, 480 << 20)
    adm.release(adm.reserve(None, 160 << 20))  # 40M expected: fits


# -- park / thaw ----------------------------------------------------------------------------------
@pytest.fixture
def swap_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A swap file of this test's own, on a disk filesystem, off and gone at the end."""
    from dsec_cli.run import density

    path = Path("/var/tmp") / f"dsec-test-{os.getpid()}-{time.time_ns()}.swap"
    density.add_swap(path, 1 << 30)
    try:
        yield path
    finally:
        density.remove_swap(path)
    assert not path.exists()


def test_park_gives_memory_back_and_thaw_keeps_files_and_processes(
        node: Node, made: list[str], swap_file: Path) -> None:
    rec = node.create(IMAGE, CreateOptions(memory=768 << 20))
    made.append(rec.id)
    # 384 MiB of random bytes resident in a live process, plus a file on disk
    hold(node, rec.id, 384, "/dev/urandom")
    assert node.exec(rec.id, ["sh", "-c", "echo kept > /root/state"]).exit_code == 0
    procs = node.exec(rec.id, ["pidof", "dd", "sleep"]).stdout.split()
    assert len(procs) == 2
    before = [d for d in node.top() if d["id"] == rec.id][0]
    assert before["resident"] >= 376 << 20
    out = node.park(rec.id)
    assert out["status"] == "parked"
    assert out["reclaimed"] >= 0.9 * before["resident"], out
    assert out["resident"] <= 0.1 * before["resident"], out
    assert out["swapped"] >= 300 << 20, out
    row = [d for d in node.top() if d["id"] == rec.id][0]
    assert row["reclaimed"] == out["reclaimed"] and row["status"] == "parked"
    node.thaw(rec.id)
    assert node.lookup(rec.id).status == "running"
    assert node.exec(rec.id, ["cat", "/root/state"]).stdout == b"kept\n"
    assert node.exec(rec.id, ["pidof", "dd", "sleep"]).stdout.split() == procs
    # the holder runs on and ends as it would have (SIGPIPE once its reader is gone)
    assert node.exec(rec.id, ["killall", "sleep"]).exit_code == 0
    wait_for(lambda: not node.exec(rec.id, ["pidof", "dd"]).stdout, "dd to finish")


def test_prefetch_reads_parked_memory_back_before_any_exec_touches_it(
        node: Node, made: list[str], swap_file: Path, node_env: dict[str, str]) -> None:
    rec = node.create(IMAGE, CreateOptions(memory=512 << 20))
    made.append(rec.id)
    hold(node, rec.id, 256, "/dev/urandom")
    procs = node.exec(rec.id, ["pidof", "dd", "sleep"]).stdout.split()
    cg = _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}")
    out = node.park(rec.id)
    assert out["resident"] <= 32 << 20, out
    node.thaw(rec.id)  # a plain thaw: the pages stay out until they are touched
    assert cg.memory_use()["resident"] <= 64 << 20
    doc = json.loads(dsec(node_env, "thaw", rec.id, "--prefetch", "--json").stdout)
    assert doc["status"] == "running" and doc["prefetched"] >= 256 << 20, doc
    # back in RAM although nothing in the sandbox ran: dd and sleep only wait on a pipe
    assert cg.memory_use()["resident"] >= 230 << 20, cg.memory_use()
    assert node.exec(rec.id, ["pidof", "dd", "sleep"]).stdout.split() == procs
    with pytest.raises(UsageError, match="cannot be pre-warmed"):
        node.pause(rec.id)
        try:
            node.thaw(rec.id, prefetch=True)
        finally:
            node.resume(rec.id)


def test_park_cli_and_errors(node: Node, made: list[str], node_env: dict[str, str]) -> None:
    rec = node.create(IMAGE, CreateOptions(backend="fncall"))
    made.append(rec.id)
    with pytest.raises(UsageError, match="not parked"):
        node.thaw(rec.id)
    doc = json.loads(dsec(node_env, "park", rec.id, "--json").stdout)
    assert doc["status"] == "parked" and {"resident", "reclaimed", "swapped"} <= set(doc)
    assert _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}").frozen()
    p = dsec(node_env, "exec", rec.id, "--", "true", check=2)
    assert b"dsec thaw" in p.stderr
    assert b"dsec thaw" in dsec(node_env, "resume", rec.id, check=2).stderr
    doc = json.loads(dsec(node_env, "thaw", rec.id, "--json").stdout)
    assert doc["status"] == "running"
    assert not _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}").frozen()
    dsec(node_env, "park", "nosuchsandbox", check=2)
    # a parked sandbox is removed like any other: nothing of it is left
    node.park(rec.id)
    node.remove(rec.id)
    made.remove(rec.id)
    assert rec.id not in leaks(str(node.root))["cgroups"]


def test_idle_reclaim_runs_from_node_gc(node: Node, made: list[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    busy = node.create(IMAGE, CreateOptions())
    idle = node.create(IMAGE, CreateOptions())
    made += [busy.id, idle.id]
    for sid in (busy.id, idle.id):  # page cache charged to each sandbox
        assert node.exec(sid, ["sh", "-c", "head -c 64m /dev/zero > /root/f && sync && "
                                           "cat /root/f > /dev/null"]).exit_code == 0
    old = time.time() - 3600
    os.utime(node.sandboxes_dir / idle.id / "active", (old, old))
    monkeypatch.setenv("DSEC_IDLE_RECLAIM", "10m")
    report = node.gc()
    assert [d["id"] for d in report["reclaimed"]] == [idle.id]
    assert report["reclaimed"][0]["reclaimed"] >= 32 << 20
    # reclaimed while frozen (so nothing allocates meanwhile), and running again after
    assert not _cgroups.Cgroup(f"{node.cgroup_parent}/{idle.id}").frozen()
    # it keeps running, and its next exec sees its files
    assert node.exec(idle.id, ["sh", "-c", "wc -c < /root/f"]).stdout.strip() == \
        str(64 << 20).encode()
    assert node.lookup(idle.id).status == "running"
    assert node.gc()["reclaimed"] == []  # touched by that exec: not idle any more


def test_top_json_reports_every_sandbox(node: Node, made: list[str],
                                        node_env: dict[str, str]) -> None:
    rec = node.create(IMAGE, CreateOptions(backend="fncall", cpu_class="latency"))
    made.append(rec.id)
    # 2 MiB of tmpfs charged to the sandbox
    assert node.exec(rec.id, ["sh", "-c", "head -c 2m /dev/zero > /tmp/x"]).exit_code == 0
    docs: list[dict[str, Any]] = json.loads(
        dsec(node_env, "top", "--json", "--interval", "0.2").stdout)
    row = [d for d in docs if d["id"] == rec.id][0]
    assert row["class"] == "latency" and row["resident"] >= 2 << 20
    assert {"cpu", "cpu_seconds", "reclaimed", "swapped", "idle_seconds"} <= set(row)


def test_node_check_reports_host_facilities(node_env: dict[str, str]) -> None:
    doc = json.loads(dsec(node_env, "node", "check", "--host", "--json").stdout)
    assert doc["cgroup_controllers"]["memory"] in ("v1", "v2")
    assert "swap_total" in doc and "ksm" in doc and isinstance(doc["notes"], list)
    # how each backend parks here, and whether CRIU could checkpoint (it is not used)
    assert set(doc["park"]) == {"container", "fncall", "microvm", "vm"}
    assert "state file" in doc["park"]["microvm"] and "freezer" in doc["park"]["container"]
    assert ("swap" in doc["park"]["container"]) and (doc["swap_total"] > 0) == \
        ("reclaimed to" in doc["park"]["container"])
    import shutil

    criu = shutil.which("criu")
    assert doc["criu"]["installed"] == (criu is not None)
    if criu is not None:
        ok = subprocess.run([criu, "check"], capture_output=True).returncode == 0
        assert doc["criu"]["usable"] == ok
    else:
        assert not doc["criu"]["usable"]
    assert any("criu" in n for n in doc["notes"]) == (not doc["criu"]["usable"])
    # per-task EEVDF slices: the kernel's own report of this process's slice decides
    with open("/proc/self/sched") as f:
        has_slice = any(line.startswith("se.slice") for line in f)
    kernel = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    assert doc["custom_slices"] == (has_slice and kernel >= (6, 12))
    assert any("slices" in n for n in doc["notes"]) == (not doc["custom_slices"])


def test_swap_setup_refuses_bad_input_and_leaves_nothing(tmp_path: Path) -> None:
    from dsec_cli.run import density

    with pytest.raises(UsageError, match="40 KiB"):
        density.add_swap(tmp_path / "s", 1024)
    assert not (tmp_path / "s").exists()
    (tmp_path / "taken").write_text("data")
    with pytest.raises(UsageError, match="not overwriting"):
        density.add_swap(tmp_path / "taken", 1 << 20)
    assert (tmp_path / "taken").read_text() == "data"
    assert subprocess.run(["swapon", "--show"], capture_output=True, text=True).stdout.count(
        str(tmp_path)) == 0


@pytest.fixture
def ksm_on() -> Iterator[None]:
    """KSM switched on and scanning fast through `dsec node setup`; the host's settings
    (and no merged pages, where it was off) restored at the end."""
    from dsec_cli.api.density import setup_node
    from dsec_cli.run import density

    saved = {n: (density.KSM / n).read_text().strip()
             for n in ("run", "pages_to_scan", "sleep_millisecs", "use_zero_pages")}
    out = setup_node(ksm=True, ksm_pages=4000)
    assert out["ksm"]["run"] == 1 and out["host"]["ksm"]["pages_to_scan"] == 4000
    try:
        yield
    finally:
        if saved["run"] != "1":
            (density.KSM / "run").write_text("2")  # unmerge what this test merged
        for name, value in saved.items():
            (density.KSM / name).write_text(value)


def mergeable_bytes(pid: int) -> int:
    """Bytes of a process's mappings marked MADV_MERGEABLE ("mg" in smaps' VmFlags)."""
    total = size = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            size = hi - lo
        elif line.startswith("VmFlags:") and "mg" in head[1:]:
            total += size
    return total


def test_ksm_merges_identical_vm_memory_and_reports_it(node: Node, made: list[str],
                                                       ksm_on: None) -> None:
    from dsec_cli.run import density

    assert density.ksm_state()["use_zero_pages"] == 1  # zeroed guest pages cost nothing
    for _ in range(2):
        rec = node.create(IMAGE, CreateOptions(backend="microvm", memory=256 << 20))
        made.append(rec.id)
        cmdline = Path(f"/proc/{rec.handle['pid']}/cmdline").read_bytes()
        assert b"mem-merge=on" in cmdline
        assert mergeable_bytes(rec.handle["pid"]) >= 256 << 20  # guest RAM is MADV_MERGEABLE
        # booted while KSM runs: the guest zeroes what it frees, so that merges too
        r = node.exec(rec.id, ["cat", "/proc/cmdline"])
        assert b"init_on_free=1" in r.stdout.split()
    # two guests booted from the same kernel and image hold identical pages: KSM merges them
    wait_for(lambda: all(d.get("ksm_merged", 0) > (1 << 20) for d in node.top()
                         if d["id"] in made), "KSM to merge guest pages", timeout=120)
    assert density.ksm_state()["saved_bytes"] > 1 << 20



def test_vm_gives_back_memory_its_guest_frees(node: Node, made: list[str]) -> None:
    rec = node.create(IMAGE, CreateOptions(backend="microvm", memory=384 << 20))
    made.append(rec.id)
    cg = _cgroups.Cgroup(f"{node.cgroup_parent}/{rec.id}")
    r = node.exec(rec.id, ["sh", "-c", "dd if=/dev/urandom bs=160M count=1 iflag=fullblock "
                                       "| md5sum"])  # 160 MiB touched in the guest, then freed
    assert r.exit_code == 0, r.stderr
    mem = cg.path("memory")
    assert mem is not None
    peak = mem / ("memory.peak" if cg.is_v2("memory") else "memory.max_usage_in_bytes")
    assert int(peak.read_text()) >= 160 << 20  # the guest's pages were QEMU's
    wait_for(lambda: cg.memory_use()["resident"] < 150 << 20,
             "the freed guest pages to leave QEMU's resident memory", timeout=90)


def test_node_setup_swap_through_the_cli(node_env: dict[str, str]) -> None:
    from dsec_cli.run import density

    path = Path("/var/tmp") / f"dsec-test-cli-{os.getpid()}-{time.time_ns()}.swap"
    try:
        doc = json.loads(dsec(node_env, "node", "setup", "--swap", "64M", "--swap-file",
                              str(path), "--json").stdout)
        assert doc["swap"] == {"file": str(path), "size": 64 << 20, "already": False}
        assert str(path) in Path("/proc/swaps").read_text()
        assert doc["host"]["swap_total"] >= 60 << 20
        again = json.loads(dsec(node_env, "node", "setup", "--swap", "64M", "--swap-file",
                                str(path), "--json").stdout)
        assert again["swap"]["already"] is True
    finally:
        density.remove_swap(path)
    assert str(path) not in Path("/proc/swaps").read_text() and not path.exists()
    for bad in (["--swap", "lots"], ["--swap", "1K"], ["--ksm-pages", "0"]):
        p = dsec(node_env, "node", "setup", *bad, "--swap-file", str(path), check=2)
        assert bad[0].encode() in p.stderr
        assert not path.exists()


def test_containers_work_while_the_caller_holds_over_1024_files(node: Node, made: list[str]
                                                                 ) -> None:
    """A process holding a thousand sandboxes keeps an agent connection to each: the fds it
    then opens are numbered past 1024, where select() cannot wait on them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        rec = node.create(IMAGE, CreateOptions(memory=256 << 20))  # waits on a pipe > 1024
        made.append(rec.id)
        r = node.exec(rec.id, ["true"])
        assert r.exit_code == 0
        pid = rec.handle["pid"]
        node.remove(rec.id)  # waits on the init's pidfd > 1024
        made.remove(rec.id)
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
