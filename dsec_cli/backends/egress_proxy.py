"""The host-side relay behind a sandbox's ``IP:PORT`` egress rules (egress.py).

A connection the sandbox opens to an allowed ``IP:PORT`` is redirected (nat PREROUTING on the
sandbox's host interface) to this relay, listening on the link's gateway address; the relay
reads where the connection was going (``SO_ORIGINAL_DST``) and opens it from the host itself.
So the host never forwards a packet of the sandbox: no ``ip_forward``, no NAT of the
sandbox's address, nothing a remote machine needs to route back. The filter only admits
connections whose original destination is an allowed rule, so the relay carries nothing else.

One relay per sandbox, started by `start` on the first ``IP:PORT`` rule: it binds, forks a
detached server (its own session, no parent to wait on it), prints ``PORT PID`` and exits.
It stops when killed by `egress.detach`, or by itself once the sandbox's interface is gone.

    python -m dsec_cli.backends.egress_proxy HOST_IF GATEWAY
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..core.errors import BackendError

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CONNECT_TIMEOUT = 30.0
#: connections relayed at once per sandbox; more are closed at once (a thread each, on the host)
MAX_CONNECTIONS = 256
MODULE = "dsec_cli.backends.egress_proxy"


def start(host_if: str, gateway: str) -> tuple[int, int]:
    """Start the relay of a sandbox's link; (its port on the gateway address, its pid)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", MODULE, host_if, gateway], capture_output=True,
                       text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise BackendError(f"the egress relay of {host_if} did not start: {r.stderr.strip()}")
    port, pid = r.stdout.split()
    return int(port), int(pid)


def find(host_if: str) -> list[int]:
    """The pids of the relays serving ``host_if`` (by their command line)."""
    want = [MODULE.encode(), host_if.encode()]
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in argv for w in want):
            out.append(int(d))
    return out


def _original_dst(conn: socket.socket) -> tuple[str, int]:
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _relay(conn: socket.socket, gateway: str) -> None:
    up = None
    try:
        host, port = _original_dst(conn)
        if host == gateway:  # reached directly, not redirected by a rule: nothing to relay
            return
        up = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        up.settimeout(None)
        t = threading.Thread(target=_pipe, args=(up, conn), daemon=True)
        t.start()
        _pipe(conn, up)
        t.join()
    except OSError:
        pass
    finally:
        conn.close()
        if up is not None:
            up.close()


def _watch(host_if: str) -> None:
    """Exit once the sandbox's interface is gone (its sandbox was removed)."""
    while Path("/sys/class/net", host_if).exists():
        time.sleep(5)
    os._exit(0)


def main(host_if: str, gateway: str) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((gateway, 0))
    srv.listen(128)
    pid = os.fork()
    if pid:
        print(srv.getsockname()[1], pid, flush=True)
        os._exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    threading.Thread(target=_watch, args=(host_if,), daemon=True).start()
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def one(conn: socket.socket) -> None:
        try:
            _relay(conn, gateway)
        finally:
            slots.release()

    while True:
        conn, _ = srv.accept()
        if not slots.acquire(blocking=False):
            conn.close()
            continue
        threading.Thread(target=one, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
