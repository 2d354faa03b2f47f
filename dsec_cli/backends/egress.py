"""Egress policy for a sandbox in its own network namespace, enforced on the host's side.

A sandbox created with ``network="allowlist"`` gets a veth pair: ``eth0`` inside (a /30
address, a default route through the host's end) and ``dse<id>`` on the host. Everything that
leaves the sandbox enters the host through that one interface, where an iptables chain of the
host (which nothing inside can see or change: the sandbox has no handle on the host's network
namespace) accepts only the allowlist and drops the rest; IPv6 is off on the link and dropped
by ip6tables. Changing its own routes, addresses or sending raw packets gets the sandbox
nothing: the filter matches on the interface, not on what a packet claims.

Rules: ``host:PORT`` (this node, reached at the gateway address: the sandbox's default
route, reported by `describe`), ``IP:PORT`` (another machine, TCP: redirected to the
sandbox's relay on the host, egress_proxy.py, so the node forwards nothing and needs no
``ip_forward``), ``host`` (every port of this node). An empty list is egress none. Every
change is appended to the sandbox's ``egress.jsonl`` (host side); `describe` reports the
dropped packets.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.errors import BackendError, UsageError

log = logging.getLogger(__name__)

#: /30 links are carved from this shared-address range, one per sandbox
POOL = ipaddress.ip_network("100.64.0.0/10")
#: a VM's tap and the bridge joining it to the link, inside the VM's own namespace
TAP, BRIDGE = "tap0", "br0"


#: a DNS name as a rule's destination: RFC 1123 labels, the last one not all digits
NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
                  r"[A-Za-z0-9]*[A-Za-z][A-Za-z0-9-]*")
#: marks the lines of a sandbox's /etc/hosts that pin its rules' names
PIN_MARK = "# dsec egress"


def parse_rule(rule: str) -> tuple[str, int | None]:
    """``host``, ``host:PORT``, ``IPV4:PORT`` or ``NAME:PORT`` -> (destination, port or
    None). A name is only checked here; `resolve` looks it up."""
    if rule == "host":
        return "host", None
    dest, sep, port_text = rule.rpartition(":")
    if not sep or not dest:
        raise UsageError(f"invalid egress rule {rule!r}: expected host, host:PORT, "
                         "IPV4:PORT or NAME:PORT")
    if dest != "host":
        try:
            ip = ipaddress.ip_address(dest)
        except ValueError:
            if not NAME.fullmatch(dest) or dest.endswith("-") or "-." in dest:
                raise UsageError(f"invalid egress rule {rule!r}: the destination must be "
                                 "`host`, an IPv4 address or a host name") from None
        else:
            _check_ip(rule, ip)
    try:
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise UsageError(f"invalid egress rule {rule!r}: port must be 1-65535") from None
    return dest, port


def _check_ip(rule: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if ip.version != 4:
        raise UsageError(f"invalid egress rule {rule!r}: IPv6 egress is not offered")
    if ip.is_loopback or ip.is_unspecified or ip.is_multicast or ip in POOL:
        raise UsageError(f"invalid egress rule {rule!r}: not another machine's address "
                         "(this node is `host:PORT`)")


def is_name(dest: str) -> bool:
    if dest == "host":
        return False
    try:
        ipaddress.ip_address(dest)
    except ValueError:
        return True
    return False


def resolve(rule: str, name: str) -> list[str]:
    """The IPv4 addresses of ``name``, looked up on the host now (the sandbox's own DNS stays
    blocked; its /etc/hosts gets them pinned)."""
    import socket

    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise UsageError(f"egress rule {rule!r}: cannot resolve {name} on this node: "
                         f"{e.strerror or e}") from None
    ips = sorted({str(i[4][0]) for i in infos})
    for ip in ips:
        _check_ip(f"{rule} ({name} is {ip})", ipaddress.ip_address(ip))
    if not ips:
        raise UsageError(f"egress rule {rule!r}: {name} has no IPv4 address")
    return ips


def hosts_file(old: bytes, pins: dict[str, list[str]]) -> bytes:
    """A sandbox's /etc/hosts with its pinned names replaced by ``pins``."""
    keep = [ln for ln in old.decode("utf-8", "replace").splitlines()
            if not ln.rstrip().endswith(PIN_MARK)]
    add = [f"{ip} {name} {PIN_MARK}" for name, ips in sorted(pins.items()) for ip in ips]
    return ("\n".join(keep + add) + "\n").encode()


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise BackendError(f"egress setup failed: {' '.join(argv)}: {r.stderr.strip()}")
    return r


def _pick_subnet(sandbox_id: str) -> ipaddress.IPv4Network:
    used = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    blocks = POOL.num_addresses // 4
    start = int(hashlib.sha256(sandbox_id.encode()).hexdigest(), 16) % blocks
    for i in range(1024):
        net = ipaddress.ip_network(
            (int(POOL.network_address) + ((start + i) % blocks) * 4, 30))
        if f" {net[1]}/" not in used:
            return net  # type: ignore[return-value]
    raise BackendError("no free egress link address")


def names(sandbox_id: str) -> dict[str, str]:
    h = hashlib.sha256(sandbox_id.encode()).hexdigest()[:9]
    return {"host_if": f"dse{h}", "peer_if": f"dsp{h}", "chain": f"DSEC-{h}",
            "netns": f"dsec-{h}"}


def make_netns(sandbox_id: str, tap: bool = True) -> str:
    """A named network namespace (``/run/netns/dsec-<h>``): for a VM's QEMU, holding the tap
    the guest's NIC uses (`attach` with ``guest=True`` bridges it to the link; nothing in it
    has an address: QEMU's process has no network of its own, the guest only the link), or
    with ``tap=False`` just loopback, for `scoped`."""
    n = names(sandbox_id)
    _run(["ip", "netns", "add", n["netns"]])
    ns = ["ip", "netns", "exec", n["netns"]]
    for key in ("all", "default"):  # before any interface exists, so none gets IPv6
        _run([*ns, "sysctl", "-q", "-w", f"net.ipv6.conf.{key}.disable_ipv6=1"])
    _run(["ip", "-n", n["netns"], "link", "set", "lo", "up"])
    if not tap:
        return n["netns"]
    _run(["ip", "-n", n["netns"], "tuntap", "add", "dev", TAP, "mode", "tap"])
    _run(["ip", "-n", n["netns"], "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "-n", n["netns"], "link", "set", TAP, "master", BRIDGE])
    return n["netns"]


@contextlib.contextmanager
def scoped(owner: str, rules: list[str], state_dir: Path) -> Iterator[dict[str, Any]]:
    """A namespace with its link and filter for the length of one command (a build's RUN):
    made and attached on entry, detached on the way out whatever happened, so nothing of it
    outlives the command. Yields the egress state (``netns``, ``pins``, ...); run the
    command under `netns_argv` of ``state["sandbox_id"]``."""
    sandbox_id = f"{owner}-{os.getpid()}-{os.urandom(6).hex()}"
    try:
        netns = make_netns(sandbox_id, tap=False)
        state = attach(sandbox_id, netns, rules, state_dir)
        state["sandbox_id"] = sandbox_id
        yield state
    finally:
        detach(sandbox_id)


def netns_argv(sandbox_id: str) -> list[str]:
    """The prefix that runs a command in a VM's namespace, or a `scoped` one (network only,
    no other)."""
    return ["nsenter", f"--net=/run/netns/{names(sandbox_id)['netns']}", "--"]


def attach(sandbox_id: str, where: int | str, rules: list[str], state_dir: Path,
           guest: bool = False) -> dict[str, Any]:
    """Give the sandbox its link and the host-side filter. ``where``: the pid of a process
    in the sandbox's network namespace, or the name of one (`make_netns`). ``guest``: the
    sandbox end is bridged to the namespace's tap and the VM's guest sets its address itself
    (`guest_setup`); else it becomes ``eth0`` there, addressed and routed."""
    n = names(sandbox_id)
    net = _pick_subnet(sandbox_id)
    gw, addr = str(net[1]), str(net[2])
    state = {**n, "gateway": gw, "address": addr, "state_dir": str(state_dir)}
    if isinstance(where, str):
        ns = ["ip", "netns", "exec", where]
    else:
        ns = ["nsenter", "-t", str(where), "-n"]
    # the link first (so `attached` sees a half-made setup), then the filter, and only then
    # does the link reach the sandbox and come up
    _run(["ip", "link", "add", n["host_if"], "type", "veth", "peer", "name", n["peer_if"]])
    for tool in ("iptables", "ip6tables"):
        _run([tool, "-w", "-N", n["chain"]], check=False)
        _run([tool, "-w", "-F", n["chain"]])
        _run([tool, "-w", "-A", n["chain"], "-j", "DROP"])
        for hook in ("INPUT", "FORWARD"):
            _run([tool, "-w", "-I", hook, "-i", n["host_if"], "-j", n["chain"]])
    _run(["sysctl", "-q", "-w", f"net.ipv6.conf.{n['host_if']}.disable_ipv6=1"])
    _run(["ip", "link", "set", n["peer_if"], "netns", str(where)])
    _run(["ip", "addr", "add", f"{gw}/30", "dev", n["host_if"]])
    _run(["ip", "link", "set", n["host_if"], "up"])
    if guest:
        for dev in (n["peer_if"], TAP, BRIDGE):
            if dev == n["peer_if"]:
                _run([*ns, "ip", "link", "set", dev, "master", BRIDGE])
            _run([*ns, "ip", "link", "set", dev, "up"])
    else:
        _run([*ns, "ip", "link", "set", n["peer_if"], "name", "eth0"])
        _run([*ns, "sysctl", "-q", "-w", "net.ipv6.conf.eth0.disable_ipv6=1"], check=False)
        _run([*ns, "ip", "addr", "add", f"{addr}/30", "dev", "eth0"])
        _run([*ns, "ip", "link", "set", "eth0", "up"])
        _run([*ns, "ip", "route", "add", "default", "via", gw])
    set_rules(state, rules)
    return state


def guest_setup(state: dict[str, Any]) -> list[str]:
    """The command a VM's guest runs (as root, once booted) to use its link."""
    return ["sh", "-c", f"ip link set eth0 up && ip addr add {state['address']}/30 dev eth0 "
            f"&& ip route add default via {state['gateway']}"]


def describe(sandbox_state: dict[str, Any]) -> dict[str, Any]:
    """What `describe` shows of a sandbox's egress (nothing without an allowlist)."""
    eg = sandbox_state.get("egress")
    if not eg:
        return {}
    return {"egress": {"rules": eg.get("rules", []), "gateway": eg["gateway"],
                       "address": eg["address"], "pins": eg.get("pins", {}),
                       "dropped": dropped(eg)}}


def set_rules(state: dict[str, Any], rules: list[str]) -> None:
    """Replace the allowlist (an empty list: nothing leaves); logged beside the sandbox.
    ``IP:PORT`` rules go through the sandbox's relay on the host (egress_proxy.py), started
    with the first one: the host forwards nothing."""
    parsed: list[tuple[str, int | None]] = []
    pins: dict[str, list[str]] = {}
    for rule in rules:
        dest, port = parse_rule(rule)
        if is_name(dest):
            pins[dest] = resolve(rule, dest)
            parsed += [(ip, port) for ip in pins[dest]]
        else:
            parsed.append((dest, port))
    chain, iface, gw = state["chain"], state["host_if"], state["gateway"]
    remote = [(d, p) for d, p in parsed if d != "host"]
    if remote:
        _ensure_relay(state)
    accept: list[list[str]] = []
    redirect: list[list[str]] = []
    for dest, port in parsed:
        if dest == "host":
            spec = ["-d", gw]
            if port is not None:
                spec += ["-p", "tcp", "--dport", str(port)]
            accept.append(spec)
            continue
        to = ["-d", dest, "-p", "tcp", "--dport", str(port)]
        redirect.append([*to, "-j", "DNAT", "--to-destination",
                         f"{gw}:{state['relay']['port']}"])
        # only what a rule redirected: the relay port reached directly is dropped
        accept.append(["-d", gw, "-p", "tcp", "--dport", str(state["relay"]["port"]),
                       "-m", "conntrack", "--ctorigdst", dest, "--ctorigdstport", str(port)])
    # fail closed while the rules change: a DROP on top, the old rules out, the new ones in
    # below it, then the DROP on top goes
    _run(["iptables", "-w", "-I", chain, "1", "-j", "DROP"])
    while _run(["iptables", "-w", "-D", chain, "2"], check=False).returncode == 0:
        pass
    if redirect or state.get("relay"):
        _ensure_nat(chain, iface)
        _run(["iptables", "-w", "-t", "nat", "-F", chain])
        for spec in redirect:
            _run(["iptables", "-w", "-t", "nat", "-A", chain, "-i", iface, *spec])
    for spec in accept:
        _run(["iptables", "-w", "-A", chain, "-i", iface, *spec, "-j", "ACCEPT"])
    _run(["iptables", "-w", "-A", chain, "-j", "DROP"])
    _run(["iptables", "-w", "-D", chain, "1"])
    entry = {"time": time.time(), "rules": list(rules)}
    with open(Path(state["state_dir"]) / "egress.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    state["rules"] = list(rules)
    state["pins"] = pins
    log.info("egress of %s: %s", state["host_if"], ", ".join(rules) or "none")


def _ensure_relay(state: dict[str, Any]) -> None:
    from . import egress_proxy

    relay = state.get("relay")
    if relay and relay.get("pid") in egress_proxy.find(state["host_if"]):
        return
    port, pid = egress_proxy.start(state["host_if"], state["gateway"])
    state["relay"] = {"port": port, "pid": pid}


def _ensure_nat(chain: str, iface: str) -> None:
    """The sandbox's nat chain (same name as its filter chain), jumped to from PREROUTING
    for its interface only."""
    if _run(["iptables", "-w", "-t", "nat", "-L", chain, "-n"], check=False).returncode != 0:
        _run(["iptables", "-w", "-t", "nat", "-N", chain])
    hook = ["PREROUTING", "-i", iface, "-j", chain]
    if _run(["iptables", "-w", "-t", "nat", "-C", *hook], check=False).returncode != 0:
        _run(["iptables", "-w", "-t", "nat", "-I", *hook])


@functools.lru_cache(maxsize=1)  # asked with every node `info`: the tools do not come and go
def host_facts() -> dict[str, Any]:
    """What allowlists need of this host, and what is missing (`dsec node check --host`):
    iproute2, iptables and ip6tables (with the nat table and conntrack match), nsenter, and
    /dev/net/tun for the VM backends. Not ``ip_forward``: the host forwards nothing."""
    import shutil

    tools = {t: shutil.which(t) is not None for t in ("ip", "iptables", "ip6tables", "nsenter")}
    nat = tools["iptables"] and _run(["iptables", "-w", "-t", "nat", "-S", "PREROUTING"],
                                     check=False).returncode == 0
    tun = Path("/dev/net/tun").exists()
    missing = [t for t, ok in tools.items() if not ok] + \
        ([] if nat else ["the iptables nat table"]) + ([] if tun else ["/dev/net/tun (VMs)"])
    return {"tools": tools, "nat": nat, "tun": tun, "ready": not missing, "missing": missing}


def dropped(state: dict[str, Any]) -> int:
    """Packets the filter dropped so far."""
    r = _run(["iptables", "-w", "-L", state["chain"], "-v", "-x", "-n"], check=False)
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "DROP":
            return int(parts[0])
    return 0


def attached(sandbox_id: str) -> bool:
    """Whether the host still holds the sandbox's link or namespace."""
    n = names(sandbox_id)
    return Path("/sys/class/net", n["host_if"]).exists() or \
        Path("/run/netns", n["netns"]).exists()


def detach(sandbox_id: str) -> None:
    """Remove the link, the filter and a VM's namespace (idempotent; works from the sandbox
    id alone)."""
    n = names(sandbox_id)
    _run(["ip", "link", "del", n["host_if"]], check=False)
    if Path("/run/netns", n["netns"]).exists():
        _run(["ip", "netns", "del", n["netns"]], check=False)
    for tool in ("iptables", "ip6tables"):
        for hook in ("INPUT", "FORWARD"):
            while _run([tool, "-w", "-D", hook, "-i", n["host_if"], "-j", n["chain"]],
                       check=False).returncode == 0:
                pass
        _run([tool, "-w", "-F", n["chain"]], check=False)
        _run([tool, "-w", "-X", n["chain"]], check=False)
    while _run(["iptables", "-w", "-t", "nat", "-D", "PREROUTING", "-i", n["host_if"], "-j",
                n["chain"]], check=False).returncode == 0:
        pass
    _run(["iptables", "-w", "-t", "nat", "-F", n["chain"]], check=False)
    _run(["iptables", "-w", "-t", "nat", "-X", n["chain"]], check=False)
    from . import egress_proxy

    for pid in egress_proxy.find(n["host_if"]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
