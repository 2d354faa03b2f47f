"""`read_file` and `write_file` act as the sandbox's user, through `Sandbox` and
`AsyncSandbox`, on real runc and bubblewrap sandboxes created as uid 1000: what they create
(the file and the parent directories they make) is the user's, permissions refuse them with
EACCES, and ``user="root"`` overrides where the backend can take another user."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any

import pytest

import dsec_cli as dsec
from dsec_cli.core.errors import DsecError, UsageError

from .conftest import IMAGE

USER = "1000:1000"


class Sync:
    """The checks' view of a sandbox: every call as the sync API makes it."""

    def __init__(self, backend: str) -> None:
        self.sb = dsec.Sandbox(IMAGE, backend, user=USER, network="none")

    def write(self, path: str, data: bytes, **kw: Any) -> None:
        self.sb.write_file(path, data, **kw)

    def read(self, path: str, **kw: Any) -> bytes:
        return self.sb.read_file(path, **kw)

    def sh(self, cmd: str, **kw: Any) -> str:
        r = self.sb.exec(cmd, **kw)
        assert r.exit_code == 0, r.stderr
        return r.stdout.decode().strip()

    def close(self) -> None:
        self.sb.remove()


class Async(Sync):
    """The same calls through `AsyncSandbox`, each run to completion on one loop."""

    def __init__(self, backend: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.sb = self.loop.run_until_complete(  # type: ignore[assignment]
            dsec.AsyncSandbox.create(IMAGE, backend, user=USER, network="none"))

    def _run(self, call: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        return self.loop.run_until_complete(call(*a, **kw))

    def write(self, path: str, data: bytes, **kw: Any) -> None:
        self._run(self.sb.write_file, path, data, **kw)

    def read(self, path: str, **kw: Any) -> bytes:
        return bytes(self._run(self.sb.read_file, path, **kw))

    def sh(self, cmd: str, **kw: Any) -> str:
        r = self._run(self.sb.exec, cmd, **kw)
        assert r.exit_code == 0, r.stderr
        return str(r.stdout.decode().strip())

    def close(self) -> None:
        try:
            self._run(self.sb.remove)
            self._run(dsec.close_sessions)
        finally:
            self.loop.close()


@pytest.fixture(params=[(b, api) for b in ("container", "fncall") for api in ("sync", "async")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def box(request: Any, node_env: dict[str, str]) -> Any:
    backend, api = request.param
    b = (Sync if api == "sync" else Async)(backend)
    try:
        yield backend, b
    finally:
        b.close()


def _errno_of(call: Callable[[], Any]) -> int | None:
    with pytest.raises(DsecError) as e:
        call()
    return e.value.errno


def test_created_files_and_parents_are_the_users(box: Any) -> None:
    _, b = box
    b.write("/tmp/made/deeper/f", b"hello")
    owners = b.sh("stat -c %u:%g /tmp/made /tmp/made/deeper /tmp/made/deeper/f")
    assert owners.split() == [USER] * 3
    assert b.read("/tmp/made/deeper/f") == b"hello"
    b.sh("rm -r /tmp/made")  # the user removes what write_file made for it


def test_permissions_refuse_the_user(box: Any) -> None:
    _, b = box
    b.write("/tmp/ro", b"x")
    b.sh("chmod 444 /tmp/ro && mkdir /tmp/closed && chmod 555 /tmp/closed && "
         "echo s > /tmp/secret && chmod 000 /tmp/secret")
    assert _errno_of(lambda: b.write("/tmp/ro", b"y")) == errno.EACCES
    assert _errno_of(lambda: b.write("/tmp/closed/f", b"y")) == errno.EACCES
    assert _errno_of(lambda: b.write("/tmp/closed/sub/f", b"y")) == errno.EACCES
    assert _errno_of(lambda: b.read("/tmp/secret")) == errno.EACCES
    assert b.read("/tmp/ro") == b"x"


def test_root_overrides_where_the_backend_can(box: Any) -> None:
    backend, b = box
    b.sh("echo s > /tmp/secret && chmod 000 /tmp/secret")
    if backend == "fncall":  # its agent is the user: another is refused, never faked
        with pytest.raises(UsageError, match="created with"):
            b.write("/tmp/as-root", b"r", user="root")
        with pytest.raises(UsageError, match="created with"):
            b.read("/tmp/secret", user="root")
        return
    assert b.read("/tmp/secret", user="root") == b"s\n"
    b.write("/etc/made-by-root/f", b"r", user="root")
    assert b.sh("stat -c %u:%g /etc/made-by-root /etc/made-by-root/f").split() == ["0:0"] * 2
    assert _errno_of(lambda: b.write("/etc/not-mine", b"u")) == errno.EACCES
    b.write("/tmp/other", b"o", user="65534:65534")
    assert b.sh("stat -c %u:%g /tmp/other") == "65534:65534"
