"""Egress policy enforced on the host's side: a sandbox with an allowlist reaches the allowed
port of this node and nothing else (another port, DNS, raw packets, IPv6, its own new routes),
the allowlist changes while it runs, and nothing of the link or the filter outlives it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.backends import egress, egress_proxy
from dsec_cli.core.errors import UsageError

from .conftest import TASK

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
              pytest.mark.usefixtures("grade_home")]

PROBE = """
import socket, sys
from concurrent.futures import ThreadPoolExecutor
def tcp(host, port, timeout=3):
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        data = s.recv(100)
        s.close()
        return "open:" + data.decode()
    except OSError as e:
        return "blocked"
def udp_dns(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.sendto(b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00"
                 b"\\x07example\\x03com\\x00\\x00\\x01\\x00\\x01", (host, 53))
        s.recvfrom(512)
        return "answered"
    except OSError:
        return "blocked"
def raw_icmp(host):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    except OSError:
        return "no-raw"
    s.settimeout(3)
    s.sendto(b"\\x08\\x00\\xf7\\xff\\x00\\x00\\x00\\x00", (host, 0))
    try:
        s.recvfrom(512)
        return "answered"
    except OSError:
        return "blocked"
def ipv6(port):
    try:
        s = socket.create_connection(("fe80::1%eth0", port), timeout=3)
        return "open"
    except OSError:
        return "blocked"
gw, allowed, other, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# a dropped packet never turns into an answer: the short waits can only err toward "blocked"
# for what should be blocked; what may be open gets a generous wait. The checks are
# independent and run side by side, so the dropped ones wait out their 3 s together
checks = [lambda: tcp(gw, allowed, 30 if want == allowed else 3),
          lambda: tcp(gw, other, 30 if want == other else 3), lambda: udp_dns(gw),
          lambda: udp_dns("8.8.8.8"), lambda: raw_icmp(gw), lambda: ipv6(allowed),
          lambda: tcp("1.1.1.1", 80)]
with ThreadPoolExecutor(len(checks)) as ex:
    print(*ex.map(lambda check: check(), checks))
"""


def _server(banner: bytes) -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(banner)
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.fixture
def servers() -> Iterator[tuple[int, int]]:
    """Two TCP services of this node: the one to allow and another one."""
    a, _ = _server(b"allowed")
    b, _ = _server(b"other")
    yield a.getsockname()[1], b.getsockname()[1]
    for s in (a, b):
        s.shutdown(socket.SHUT_RDWR)
        s.close()


def _probe(sb: Sandbox, gw: str, allowed: int, other: int, want: int = 0) -> list[str]:
    """What the sandbox reaches; ``want``: the port expected open (waited for longer)."""
    sb.write_file("/tmp/probe.py", PROBE)
    r = sb.exec(["python3", "/tmp/probe.py", gw, str(allowed), str(other), str(want)],
                timeout=300)
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode().split()


def _leftovers(sid: str) -> list[str]:
    n = egress.names(sid)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    rules = "".join(subprocess.run([*t, "-w", "-S"], capture_output=True, text=True).stdout
                    for t in (["iptables"], ["ip6tables"], ["iptables", "-t", "nat"]))
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    relays = [f"relay {p}" for p in egress_proxy.find(n["host_if"])]
    return relays + [x for x in (n["host_if"], n["chain"], n["netns"])
                     if x in links or x in rules or x in netns.split()]


#: what the probe reports where the wall holds; fncall sandboxes hold no capability, so a raw
#: socket is refused before anything is sent
WALL = ["open:allowed", "blocked", "blocked", "blocked", "blocked", "blocked", "blocked"]


@pytest.mark.parametrize("backend", [
    "container", "fncall",
    # the guest's NIC is a tap in QEMU's own namespace, bridged to the same filtered link
    # and booted from a saved template (the template's boot had no rules; the restored
    # guest is addressed after it resumes)
    pytest.param("microvm", marks=pytest.mark.slow)])
def test_allowlist_reaches_only_the_allowed_port(servers: tuple[int, int], node: Any,
                                                 backend: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    allowed, other = servers
    if backend == "microvm":
        monkeypatch.setenv("DSEC_VM_BOOT", "snapshot")
    with Sandbox(TASK, backend, network="allowlist", egress=[f"host:{allowed}"]) as sb:
        if backend == "microvm":  # restored, not the cold boot a failed restore falls back to
            assert node.handle_of(node.lookup(sb.id)).state.get("restored"), sb.info()
        info = sb.info()["egress"]
        gw = info["gateway"]
        assert info["rules"] == [f"host:{allowed}"]
        got = _probe(sb, gw, allowed, other, allowed)
        if backend == "fncall":
            assert got[4] == "no-raw"
            got[4] = "blocked"
        assert got == WALL
        # the sandbox's root changes its own routes and addresses: nothing more gets out
        sb.exec("ip route add 192.0.2.0/24 dev eth0; ip addr add 10.9.9.9/32 dev eth0; true")
        assert _probe(sb, gw, allowed, other)[1] == "blocked"
        assert sb.info()["egress"]["dropped"] > 0
        # changed while it runs, logged on the host's side
        sb.set_egress([f"host:{other}"])
        assert _probe(sb, gw, allowed, other, other)[:2] == ["blocked", "open:other"]
        # parked and thawed (a VM: saved to a file, QEMU ended, started again): the same
        # namespace and filter hold it
        sb.park()
        sb.thaw()
        assert _probe(sb, gw, allowed, other, other)[:2] == ["blocked", "open:other"]
        sb.set_egress([])
        assert _probe(sb, gw, allowed, other)[:2] == ["blocked", "blocked"]
        log = (Path(node.root) / "sandboxes" / sb.id / "egress.jsonl").read_text()
        assert [json.loads(x)["rules"] for x in log.splitlines()] == [
            [f"host:{allowed}"], [f"host:{other}"], []]
        sid = sb.id
    assert _leftovers(sid) == []


def test_egress_none_is_the_default_and_rules_are_checked(servers: tuple[int, int]) -> None:
    allowed, other = servers
    with Sandbox(TASK) as sb:  # egress none: no link at all
        assert "egress" not in sb.info()
        r = sb.exec("ip -o link 2>/dev/null | grep -c eth0; true")
        assert r.stdout.strip() in (b"0", b"")
        with pytest.raises(UsageError, match="not created with network allowlist"):
            sb.set_egress([f"host:{allowed}"])
    for bad in ("host:0", "host:x", "bad_name.test:80", "::1:80", "10.0.0.1", "127.0.0.1:80",
                "100.64.0.1:80"):
        with pytest.raises(UsageError, match="invalid egress rule"):
            Sandbox(TASK, network="allowlist", egress=[bad])
    with pytest.raises(UsageError, match="need network allowlist"):
        Sandbox(TASK, egress=[f"host:{allowed}"])


def _dsec(env: dict[str, str], *argv: str, via_typer: bool = False
          ) -> subprocess.CompletedProcess[str]:
    """`dsec ARGV` in a fresh interpreter, by the fast launcher when it takes the form, or
    always by typer."""
    skip_fast = "fast.run = lambda argv: None\n" if via_typer else ""
    code = ("import sys\nfrom dsec_cli.cli import fast, main\n" + skip_fast +
            "sys.argv = ['dsec', *sys.argv[1:]]\nmain()\n")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


@pytest.mark.parametrize("via_typer", [False, True], ids=["launcher", "typer"])
def test_cli_run_egress_reaches_only_the_allowed_port(servers: tuple[int, int],
                                                      grade_env: dict[str, str],
                                                      via_typer: bool) -> None:
    allowed, other = servers
    p = _dsec(grade_env, "run", "-d", "--network", "allowlist", "--egress", f"host:{allowed}",
              TASK, via_typer=via_typer)
    assert p.returncode == 0, p.stderr
    sid = p.stdout.strip()
    try:
        sb = Sandbox.attach(sid)
        info = sb.info()["egress"]
        assert info["rules"] == [f"host:{allowed}"]
        assert _probe(sb, info["gateway"], allowed, other, allowed)[:2] == [
            "open:allowed", "blocked"]
    finally:
        rm = _dsec(grade_env, "rm", sid)
        assert rm.returncode == 0, rm.stderr
    assert _leftovers(sid) == []


@pytest.mark.parametrize("via_typer", [False, True], ids=["launcher", "typer"])
def test_cli_run_refuses_bad_egress_naming_it(grade_env: dict[str, str],
                                              via_typer: bool) -> None:
    before = _dsec(grade_env, "ps", "--json")
    assert before.returncode == 0, before.stderr
    for argv, named in (
            (["--network", "allowlist", "--egress", "host:70000"], "host:70000"),
            (["--network", "allowlist", "--egress", "host:1", "--egress", "bad_name.test:80"],
             "bad_name.test:80"),
            (["--egress", "host:8080"], "host:8080"),  # without --network allowlist
    ):
        p = _dsec(grade_env, "run", "-d", *argv, TASK, via_typer=via_typer)
        assert p.returncode == 2, (argv, p.stderr)
        assert named in p.stderr, (argv, p.stderr)
    after = _dsec(grade_env, "ps", "--json")
    assert after.returncode == 0, after.stderr
    ids = [[r["id"] for r in json.loads(p.stdout)] for p in (before, after)]
    assert ids[1] == ids[0]  # nothing was made


REMOTE_SERVER = """
import socket, sys, threading
def serve(srv):
    while True:
        c, addr = srv.accept()
        c.sendall(("from:" + addr[0]).encode())
        c.close()
ports = []
for _ in range(2):
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    ports.append(srv.getsockname()[1])
    threading.Thread(target=serve, args=(srv,), daemon=True).start()
print(*ports, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def remote_machine() -> Iterator[tuple[str, str, int, int]]:
    """Another machine: a network namespace behind a veth of this host, on a /30 of the
    benchmarking range no interface here uses, serving two TCP ports (each answers with the
    address the connection came from). Nothing routes from it back to any sandbox.
    (host's address, its address, allowed port, other port)"""
    tag = os.urandom(3).hex()
    ns, a, b = f"dsect{tag}", f"dsta{tag}", f"dstb{tag}"
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    base = next(f"198.18.{i // 64}.{i % 64 * 4}" for i in
                (int.from_bytes(os.urandom(2), "big") % 16384 for _ in range(1000))
                if f"198.18.{i // 64}.{i % 64 * 4 + 1}/" not in used)
    prefix, last = base.rsplit(".", 1)
    here, there = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
    server = None
    try:
        for argv in (["ip", "netns", "add", ns],
                     ["ip", "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns],
                     ["ip", "addr", "add", f"{here}/30", "dev", a],
                     ["ip", "link", "set", a, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{there}/30", "dev", b],
                     ["ip", "-n", ns, "link", "set", b, "up"],
                     ["ip", "-n", ns, "link", "set", "lo", "up"]):
            subprocess.run(argv, check=True, capture_output=True)
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c",
                                   REMOTE_SERVER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        p1, p2 = map(int, server.stdout.readline().split())
        yield here, there, p1, p2
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


REMOTE_PROBE = """
import socket, sys
from concurrent.futures import ThreadPoolExecutor
out = []
# (host, port, wait): a dropped packet never turns into an answer, so a short wait can only
# err toward "blocked" for what should be blocked; what may be open gets a generous one
for host, port, wait in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    try:
        s = socket.create_connection((host, int(port)), timeout=float(wait))
        out.append(s.recv(100).decode() or "closed")
        s.close()
    except OSError:
        out.append("blocked")
print(*out)
"""


def test_ip_rules_reach_another_machine_through_the_host_relay(
        remote_machine: tuple[str, str, int, int]) -> None:
    """`IP:PORT` works with the host's ip_forward as it is (off here): the relay on the host
    opens the connection, so the other machine sees the host's address, never the sandbox's;
    the other port, and the relay reached directly, stay blocked."""
    here, there, allowed, other = remote_machine
    with Sandbox(TASK, network="allowlist") as sb:
        sb.write_file("/tmp/remote.py", REMOTE_PROBE)

        def probe(*targets: object) -> list[str]:
            r = sb.exec(["python3", "/tmp/remote.py", *map(str, targets)], timeout=300)
            assert r.exit_code == 0, r.stderr
            return r.stdout.decode().split()

        assert probe(there, allowed, 3) == ["blocked"]
        sb.set_egress([f"{there}:{allowed}"])
        relay = sb.node.handle_of(sb.node.lookup(sb.id)).state["egress"]["relay"]
        gw = sb.info()["egress"]["gateway"]
        assert probe(there, allowed, 30, there, other, 3, gw, relay["port"], 3) == [
            f"from:{here}", "blocked", "blocked"]
        sb.set_egress([])
        assert probe(there, allowed, 3) == ["blocked"]
        sid = sb.id
    assert _leftovers(sid) == []


def test_node_check_says_what_allowlists_need(grade_env: dict[str, str]) -> None:
    p = _dsec(grade_env, "node", "check", "--host", "--json", via_typer=True)
    assert p.returncode == 0, p.stderr
    eg = json.loads(p.stdout)["egress"]
    assert eg["ready"] and eg["missing"] == [] and eg["nat"] and eg["tun"]
    p = _dsec(grade_env, "node", "check", "--host", via_typer=True)
    assert "egress:   allowlists ready (ip_forward not needed)" in p.stdout, p.stdout


NAME_SETTER = """
import json, sys
from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.core.errors import UsageError
sb = Sandbox.attach(sys.argv[1])
try:
    sb.set_egress(["loop.test:80"])
    print("accepted")
except UsageError as e:
    print("refused", e.message.replace(" ", "_"))
print(json.dumps(sb.set_egress(["mirror.test:" + sys.argv[2]])))
"""


def test_name_rules_resolve_on_the_host_and_are_pinned_inside(
        remote_machine: tuple[str, str, int, int], tmp_path: Path) -> None:
    """`NAME:PORT` is looked up on the host when set (here in a private mount namespace whose
    /etc/hosts names the other machine, so nothing of the host changes), the addresses go
    through the relay and are pinned in the sandbox's /etc/hosts, DNS stays blocked; a name
    of this host's loopback or one that does not resolve is refused and changes nothing."""
    here, there, allowed, other = remote_machine
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 loop.test\n{there} mirror.test\n")
    with Sandbox(TASK, network="allowlist", egress=[]) as sb:
        sb.write_file("/tmp/remote.py", REMOTE_PROBE)
        p = subprocess.run(["unshare", "-m", "sh", "-c",
                            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
                            sys.executable, "-c", NAME_SETTER, sb.id, str(allowed)],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        first, second = p.stdout.splitlines()
        assert first.startswith("refused") and "loop.test" in first, first
        out = json.loads(second)
        assert out["rules"] == [f"mirror.test:{allowed}"]
        assert out["pins"] == {"mirror.test": [there]}
        assert f"{there} mirror.test" in sb.read_file("/etc/hosts").decode()
        r = sb.exec(["python3", "/tmp/remote.py", "mirror.test", str(allowed), "30",
                     "mirror.test", str(other), "3", there, str(other), "3"], timeout=300)
        assert r.stdout.decode().split() == [f"from:{here}", "blocked", "blocked"], r.stderr
        with pytest.raises(UsageError, match="cannot resolve"):
            sb.set_egress(["no-such-name.invalid:80"])
        assert sb.info()["egress"]["rules"] == [f"mirror.test:{allowed}"]  # unchanged
        sb.set_egress([])  # the pins go with the rules
        assert "mirror.test" not in sb.read_file("/etc/hosts").decode()
        sid = sb.id
    assert _leftovers(sid) == []


@pytest.mark.slow
def test_vm_create_killed_midway_leaves_no_link_namespace_or_qemu(node: Any) -> None:
    """kill -9 of a process creating a microvm with an allowlist, once its QEMU runs in the
    sandbox's namespace: the node's reconcile removes QEMU, the namespace, the link and the
    chains."""
    from dsec_cli.backends.vm.qemuproc import find_qemu

    code = ("import sys; from dsec_cli.api.sandboxes import Sandbox\n"
            "Sandbox(sys.argv[1], 'microvm', network='allowlist', egress=['host:9'])\n")
    before = {r.id for r in node.db.all()}
    p = subprocess.Popen([sys.executable, "-c", code, TASK], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    sid = ""
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            new = {r.id for r in node.db.all()} - before
            sid = next(iter(new), "")
            if sid and Path("/run/netns", egress.names(sid)["netns"]).exists() \
                    and find_qemu(sid) is not None:
                break
            assert p.poll() is None, "the create ended before its QEMU was seen"
            time.sleep(0.1)
        assert sid and find_qemu(sid) is not None, "no QEMU started in the namespace"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    assert sid not in {r.id for r in node.sandboxes()}  # reconciled: the create was aborted
    assert find_qemu(sid) is None
    assert _leftovers(sid) == []
