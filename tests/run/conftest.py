"""Shared fixtures for sandbox tests: one file store with the busybox layer built into it
(session-wide), and a node state dir per test module. Everything real: runc, bwrap, overlay
mounts, cgroups. Needs root."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE = "busybox@1.35-1"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.fixture(scope="session")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("store")
    data = tmp_path_factory.mktemp("data")
    os.environ["XDG_DATA_HOME"] = str(data)  # chunk tables and build cache stay in the temp dir
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    from dsec_cli.build.builder import build

    url = root.as_uri()
    build([REPO / "layerspecs/busybox/busybox.yaml"], url)
    return url


@pytest.fixture(scope="module")
def node_env(tmp_path_factory: pytest.TempPathFactory, store_url: str) -> Iterator[dict[str, str]]:
    """DSEC_* variables for one node state dir; everything left is removed at the end."""
    state = tmp_path_factory.mktemp("node")
    env = {"DSEC_STATE_DIR": str(state), "DSEC_STORE": store_url,
           "XDG_DATA_HOME": os.environ["XDG_DATA_HOME"]}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    from dsec_cli.run.node import Node

    n = Node(state, store_url)
    for r in n.db.all():
        n.remove(r.id)
    n.gc(budget=0)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def node(node_env: dict[str, str]) -> object:
    from dsec_cli.run.node import Node

    return Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"])


def dsec(env: dict[str, str], *args: str, input: bytes | None = None,
         check: int | None = 0) -> subprocess.CompletedProcess[bytes]:
    """Run the real `dsec` console script."""
    exe = Path(os.sys.executable).with_name("dsec")  # type: ignore[attr-defined]
    p = subprocess.run([str(exe), *args], input=input, capture_output=True,
                       env={**os.environ, **env})
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
