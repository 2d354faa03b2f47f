"""Shared fixtures for sandbox tests: one file store with the busybox layer built into it
(session-wide), and a node state dir per test module. Everything real: runc, bwrap, overlay
mounts, cgroups. Needs root."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import build_store, node_env_of, skip_unless, use_node_env

REPO = Path(__file__).resolve().parents[2]
IMAGE = "busybox@1.35-1"

requires_root = skip_unless(os.geteuid() == 0, "sandboxes need root")


@pytest.fixture(scope="session")
def sandbox_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def store_url(tmp_path_factory: pytest.TempPathFactory, sandbox_data: Path) -> str:
    root = tmp_path_factory.mktemp("store")
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    return build_store([REPO / "layerspecs/busybox/busybox.yaml"], root.as_uri(), sandbox_data)


@pytest.fixture(scope="module")
def node_env(tmp_path_factory: pytest.TempPathFactory, store_url: str,
             sandbox_data: Path) -> Iterator[dict[str, str]]:
    """DSEC_* variables for one node state dir; everything left is removed at the end."""
    yield from node_env_of(tmp_path_factory, store_url, sandbox_data)


@pytest.fixture(autouse=True)
def dsec_home(node_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Overrides the suite-wide isolated home: sandbox tests share one node and store per
    module (creating a store and a node per test would cost seconds each)."""
    use_node_env(node_env, monkeypatch)


@pytest.fixture(scope="module")
def node(node_env: dict[str, str]) -> object:
    from dsec_cli.run.node import Node

    return Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])


def dsec(env: dict[str, str], *args: str, input: bytes | None = None,
         check: int | None = 0, timeout: float = 600) -> subprocess.CompletedProcess[bytes]:
    """Run the real `dsec` console script (a run longer than `timeout` fails the test)."""
    exe = Path(os.sys.executable).with_name("dsec")  # type: ignore[attr-defined]
    p = subprocess.run([str(exe), *args], input=input, capture_output=True,
                       env={**os.environ, **env}, timeout=timeout)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def leaks(state_dir: str) -> dict[str, object]:
    """Mounts, cgroups and processes a node state dir still holds."""
    from dsec_cli.backends import _cgroups, _rootfs
    from dsec_cli.run.node import Node

    n = Node(state_dir)
    sbx = Path(state_dir) / "sandboxes"
    return {"mounts": _rootfs.mounts_under(Path(state_dir)),
            "cgroups": sorted(_cgroups.children(n.cgroup_parent)),
            "dirs": sorted(p.name for p in sbx.iterdir()) if sbx.is_dir() else []}
