"""The host end of a guest's agent channel: the unix socket of its virtio-serial port,
which QEMU serves one connection at a time. Connections are made again until the agent
answers (a guest still booting, or a connection a killed process left behind), and a
restored guest's first request gives it its own identity."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ...core.errors import SandboxError
from ...core.rundir import socket_is_ours
from ..base import SandboxHandle
from ..sandbox_agent.client import AgentClient, AgentError
from .qemuargv import safe_hostname

#: how long one connection waits for the agent's answer before it is made again
AGENT_RETRY = 10.0
#: the same for a guest just restored: its agent may still be reopening its port after the
#: template's connection went away, which can swallow the first request
RESTORED_RETRY = 1.0


#: a guest's first request on a new connection, instead of a ping
First = Callable[[AgentClient], None]


def open_agent(timeout: float, ping: Callable[[float, First | None], AgentClient | None],
               running: Callable[[], bool], retry: float = AGENT_RETRY,
               first: First | None = None) -> AgentClient:
    """A client whose agent answered a ping within `timeout` (QEMU accepts one
    connection on the port's socket at a time: a second process waits its turn, and a
    guest still booting has not opened the port yet). A connection that gets no answer
    is dropped and made again every few seconds: one left behind by a killed process can
    stay unanswered while a new one is served. A shorter first ``retry`` doubles up to
    the usual one, so a slow guest is still given time to answer. Fails early if QEMU
    exits (``running`` turns false). ``ping`` makes one connection and waits for its answer
    (`ping_within`); ``first``, when given, is the first request instead of a ping."""
    deadline = time.monotonic() + timeout
    while True:
        client = ping(min(retry, deadline - time.monotonic()), first)
        if client is not None:
            return client
        retry = min(retry * 2, AGENT_RETRY)
        if not running():
            raise SandboxError("QEMU exited")
        if time.monotonic() >= deadline:
            raise SandboxError(f"the guest agent did not answer within {timeout:.0f}s "
                               "(still booting, or another process holds its connection)")


def ping_within(handle: SandboxHandle, wait: float, running: Callable[[], bool],
                first: First | None = None) -> AgentClient | None:
    """One connection and one ping (or ``first``): the client if the agent answered
    within `wait`."""
    deadline = time.monotonic() + max(wait, 0.1)
    if not socket_is_ours(handle.state["agent_sock"]):
        raise SandboxError(f"the agent socket of sandbox {handle.sandbox_id} "
                           f"({handle.state['agent_sock']}) is not one this user made in "
                           "a private directory: not connecting to it")
    try:
        # the host end of the guest's virtio-serial port: only QEMU itself may serve it
        client = AgentClient.connect_unix(
            handle.state["agent_sock"], peer=lambda pid: pid == handle.state.get("pid"),
            what=f"sandbox {handle.sandbox_id}")
    except AgentError as e:
        if isinstance(e.__cause__, BlockingIOError):
            # QEMU's accept queue is full: it is busy (loading a restore's stream) and
            # has not yet taken the connections given up on before this one
            time.sleep(max(0.0, min(deadline - time.monotonic(), 0.1)))
            return None
        raise SandboxError(f"cannot reach the agent of sandbox {handle.sandbox_id}: {e}") \
            from e
    done = threading.Event()
    error: list[BaseException] = []

    def ping() -> None:
        try:
            if first is None:
                client.ping()
            else:
                first(client)
        except BaseException as e:  # noqa: BLE001 - reported below
            error.append(e)
        done.set()

    threading.Thread(target=ping, daemon=True).start()
    while not done.wait(0.02):
        if not running() or time.monotonic() > deadline:
            client.close()
            done.wait(5)
            return None
    if error:
        client.close()
        if isinstance(error[0], SandboxError) and not isinstance(error[0], AgentError):
            raise error[0]
        raise SandboxError(f"the guest agent failed: {error[0]}")
    return client


def identity_request(handle: SandboxHandle, hostname: str) -> First:
    """The restored guest's first agent request: the agent itself gives the guest its
    hostname, a CRNG reseeded from host randomness and a fresh machine id (what it must
    not share with its template or its siblings); its answer is also the agent's first.
    A connection that gets none in time is made again and sends the request again (the
    request is idempotent, and each carries its own random bytes)."""
    attempts = 0

    def first(client: AgentClient) -> None:
        nonlocal attempts
        attempts += 1
        # the guest's agent reads one stream across host connections: what an earlier
        # connection sent may still be answered, so this one's request ids must not be
        # the ones it used
        client.ids_from(attempts << 20)
        try:
            client.identity(safe_hostname(hostname), os.urandom(16).hex(),
                            os.urandom(256))
        except AgentError as e:
            raise SandboxError(f"giving restored sandbox {handle.sandbox_id} its "
                               f"identity failed: {e}") from e

    return first


def console_tail(handle: SandboxHandle, lines: int = 8) -> str:
    """The last lines of the guest's console log, for an error message."""
    try:
        text = Path(handle.state["console"]).read_text(errors="replace")
    except (OSError, KeyError):
        return "(no console output)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no console output)"
