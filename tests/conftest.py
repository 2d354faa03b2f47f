"""Fixtures shared by every test: an isolated home for dsec, a CLI runner, tree comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def skip_unless(ok: bool, reason: str):  # type: ignore[no-untyped-def]
    """A guard for a folder's conftest.py, assigned to a name there: every test of the folder
    is skipped (and reported as skipped) unless `ok`. `pytestmark` works in test modules only;
    pytest ignores it in a conftest.py."""

    @pytest.fixture(scope="session", autouse=True)
    def guard() -> None:
        if not ok:
            pytest.skip(reason)

    return guard


def command_servers(marker: str) -> list[int]:
    """Pids of dsec command servers (dsec_cli/cli/server.py) whose environment mentions
    ``marker`` (a directory of this test session)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"dsec_cli.cli.server import serve" not in f.read():
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(d))
        except OSError:
            continue
    return out


@pytest.fixture(scope="session", autouse=True)
def no_command_servers_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`dsec` calls start command servers on demand (they exit when idle). The suite's
    commands run in-process (``DSEC_CLI_SERVER=0``), each test of the server itself
    (tests/run/test_cli_fast.py) sets or clears it; servers keep their sockets in a
    directory of this session's own and are stopped when it ends, so no process or file
    outlives the suite."""
    import signal

    base = tmp_path_factory.getbasetemp()
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    old = {k: os.environ.get(k) for k in ("XDG_RUNTIME_DIR", "DSEC_RUNTIME_DIR",
                                           "DSEC_CLI_SERVER")}
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    os.environ["DSEC_RUNTIME_DIR"] = str(runtime)  # root's runtime dirs pass XDG's over
    os.environ["DSEC_CLI_SERVER"] = "0"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for pid in command_servers(str(base)):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.fixture(autouse=True)
def dsec_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own data, config and state directories, never the user's."""
    home = tmp_path / "home"
    for var, sub in (("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "config")):
        (home / sub).mkdir(parents=True)
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("DSEC_STATE_DIR", str(home / "state"))
    for var in ("DSEC_STORE", "DSEC_DATA_DIR", "DSEC_CONFIG", "SOURCE_DATE_EPOCH"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def run_dsec(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Run the real `dsec` command line in a subprocess (the environment of the test)."""

    def run(*args: str, check: bool | int = True, cwd: Path | None = None,
            env: dict[str, str] | None = None, input: bytes | None = None
            ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", "from dsec_cli.cli import main; main()", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or REPO,
                           env={**os.environ, **(env or {}), "COLUMNS": "200"},
                           input=input.decode() if input else None, timeout=600)
        expected = 0 if check is True else check
        if check is not False and p.returncode != expected:
            raise AssertionError(f"dsec {' '.join(args)} exited {p.returncode}, wanted "
                                 f"{expected}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
        return p

    return run


@pytest.fixture(scope="session")
def busybox_tar() -> Path:
    """The example base layer's root filesystem tarball (made from busybox-static)."""
    script = REPO / "layerspecs/busybox/make-rootfs.sh"
    subprocess.run([str(script)], check=True)
    return REPO / "layerspecs/busybox/busybox-rootfs.tar"


@contextmanager
def data_home(data: Path) -> Iterator[None]:
    """XDG_DATA_HOME set to ``data`` (chunk tables and build cache) inside the block, restored
    after it."""
    old = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(data)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_DATA_HOME", None)
        else:
            os.environ["XDG_DATA_HOME"] = old


def build_store(specs: Sequence[Path], url: str, data: Path) -> str:
    """Build layer and image specs into the store at ``url`` with ``data`` as the build's
    data home; returns ``url``."""
    from dsec_cli.build.builder import build

    with data_home(data):
        build(list(specs), url)
    return url


def node_env_of(tmp_path_factory: pytest.TempPathFactory, store: str,
                data: Path) -> Iterator[dict[str, str]]:
    """The body of a module-scoped node fixture (``yield from`` it): DSEC_* variables for a
    fresh node state dir on ``store``; every sandbox left is removed at the end."""
    state = tmp_path_factory.mktemp("node")
    config = tmp_path_factory.mktemp("config")  # never the user's own config
    env = {"DSEC_STATE_DIR": str(state), "DSEC_STORE": store,
           "XDG_DATA_HOME": str(data), "XDG_CONFIG_HOME": str(config)}
    yield env
    from dsec_cli.run.node import Node

    n = Node(state, store)
    for r in n.db.all():
        n.remove(r.id)
    n.gc(budget=0)


def use_node_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A module's node (`node_env_of`) as this test's dsec settings."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for var in ("DSEC_DATA_DIR", "DSEC_CONFIG"):
        monkeypatch.delenv(var, raising=False)
