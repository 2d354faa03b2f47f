"""Real cluster nodes on this machine: one OpenSSH sshd per node on a free loopback port,
each with its own host key, authorized key, and node environment (its own DSEC_STATE_DIR,
the shared file:// store) set by sshd's ``SetEnv``, running this checkout's dsec. Used by the
tests (tests/cluster/conftest.py) and the benchmark (benchmarks/bench_placement.py). Nothing
touches the user's ~/.ssh: keys, known_hosts and control sockets live in temp dirs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SSHD = "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    return path.with_suffix(".pub").read_text().strip() if path.suffix else \
        Path(str(path) + ".pub").read_text().strip()


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class SshNode:
    name: str
    root: Path
    port: int
    host_pub: str
    state_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def agent_dir(self) -> Path:
        """Where the node's resident services keep their sockets and pid files."""
        return Path(self.env["DSEC_AGENT_DIR"])

    def agent_pids(self) -> set[int]:
        """The node's running resident services (by their pid files)."""
        pids = set()
        for f in self.agent_dir.glob("*.pid"):
            try:
                pid = int(f.read_text().split()[0])
                os.kill(pid, 0)
            except (OSError, ValueError, IndexError):
                continue
            pids.add(pid)
        return pids

    def agent_processes(self, sock: str | None = None) -> set[int]:
        """Every process serving one of the node's resident sockets (or ``sock``), pid file or
        not."""
        out = set()
        marker = (sock or str(self.agent_dir)).encode()
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        if marker in f.read() and int(d) != os.getpid():
                            out.add(int(d))
                except OSError:
                    continue
        return out

    @property
    def address(self) -> str:
        return f"root@127.0.0.1:{self.port}"

    def known_hosts_line(self) -> str:
        kind, key = self.host_pub.split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {key}"

    def set_capacity(self, **cap: object) -> None:
        (self.state_dir / "capacity.yaml").write_text(yaml.safe_dump(cap))

    def start(self) -> None:
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.root / "sshd_config")],
                                     stdout=subprocess.DEVNULL,
                                     stderr=open(self.root / "sshd.log", "ab"),
                                     start_new_session=True)
        deadline = time.monotonic() + 60  # generous: a loaded machine starts sshd slowly
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd for {self.name} did not start: "
                           f"{(self.root / 'sshd.log').read_text()[-2000:]}")

    def stop(self) -> None:
        """Kill sshd, every session under it and the node's resident services: the node is
        gone."""
        if self.proc is None:
            return
        pids = [self.proc.pid, *descendants(self.proc.pid), *self.agent_processes()]
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None


@dataclass
class SshCluster:
    root: Path
    identity: Path
    known_hosts: Path
    control_dir: Path
    store_url: str
    nodes: list[SshNode] = field(default_factory=list)

    def client_env(self) -> dict[str, str]:
        return {"DSEC_SSH_CONTROL_DIR": str(self.control_dir), "DSEC_SSH_CONFIG": "/dev/null"}

    def config_nodes(self, names: list[str] | None = None) -> dict[str, dict[str, object]]:
        dsec = str(Path(sys.executable).with_name("dsec"))
        return {n.name: {"address": n.address, "identity": str(self.identity),
                         "known_hosts": str(self.known_hosts), "dsec": dsec}
                for n in self.nodes if names is None or n.name in names}

    def add_node(self, name: str, data_dir: Path) -> SshNode:
        root = self.root / name
        root.mkdir()
        host_pub = keygen(root / "ssh_host_ed25519_key")
        state = root / "state"
        state.mkdir()
        port = free_port()
        agents = Path(f"{self.control_dir}-{name}")  # short: socket path limit
        agents.mkdir(mode=0o700)
        env = {"DSEC_STATE_DIR": str(state), "DSEC_STORE": self.store_url,
               "DSEC_AGENT_DIR": str(agents),
               "XDG_DATA_HOME": str(data_dir), "DSEC_CONFIG": str(root / "config.yaml"),
               "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               # this checkout's code, even where the venv's dsec is installed from another
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        (root / "authorized_keys").write_text(
            Path(str(self.identity) + ".pub").read_text())
        setenv = " ".join(f"{k}={v}" for k, v in env.items())
        (root / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {root}/ssh_host_ed25519_key
PidFile {root}/sshd.pid
AuthorizedKeysFile {root}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
MaxSessions 256
MaxStartups 256:30:512
LogLevel ERROR
SetEnv {setenv}
""")
        node = SshNode(name, root, port, host_pub, state, env)
        with open(self.known_hosts, "a") as f:
            f.write(node.known_hosts_line() + "\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        node.start()
        self.nodes.append(node)
        return node

    def close_masters(self) -> None:
        for sock in self.control_dir.iterdir():
            if sock.is_socket() and "-" not in sock.name:  # not a forward's local end
                subprocess.run(["ssh", "-F", "/dev/null", "-o", f"ControlPath={sock}",
                                "-O", "exit", "x"], capture_output=True, timeout=10)

    def cleanup_node(self, node: SshNode) -> None:
        """Remove every sandbox a node still holds, through the node's own API, and the
        files of its (stopped) resident services."""
        from dsec_cli.run.node import Node

        shutil.rmtree(node.agent_dir, ignore_errors=True)
        n = Node(node.state_dir, self.store_url)
        for r in n.db.all():
            try:
                n.remove(r.id)
            except Exception:  # best effort at teardown: a leak here shows in leak checks
                pass
        n.gc(budget=0)


def make_cluster(root: Path, store_url: str, data_dir: Path, count: int) -> SshCluster:
    client = root / "client"
    client.mkdir(parents=True)
    ctl = Path(f"/tmp/dsec-t-{os.getpid()}-{os.urandom(3).hex()}")  # short: socket path limit
    ctl.mkdir(mode=0o700)
    identity = client / "id_ed25519"
    keygen(identity)
    c = SshCluster(root, identity, client / "known_hosts", ctl, store_url)
    c.known_hosts.touch()
    for i in range(count):
        c.add_node(f"node{i + 1}", data_dir)
    return c


def destroy_cluster(c: SshCluster) -> None:
    from dsec_cli.run.cluster.remote import close_all

    close_all()
    c.close_masters()
    for n in c.nodes:
        n.stop()
        c.cleanup_node(n)
    for p in c.control_dir.iterdir():
        p.unlink()
    c.control_dir.rmdir()

