"""Session fixtures for cluster tests: a file:// store holding the busybox layer and a small
extra layer, and three real nodes (sshd on loopback ports, see sshnodes.py) with capacities
20, 40 and 60 sandboxes. Each test gets the nodes in its own (fresh) user config."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import build_store, skip_unless

from .sshnodes import SshCluster, destroy_cluster, make_cluster

REPO = Path(__file__).resolve().parents[2]
IMAGE = "busybox@1.35-1"
TINY = "tiny@1"
CAPACITY = {"node1": 20, "node2": 40, "node3": 60}

requires_root = skip_unless(os.geteuid() == 0, "sandboxes and sshd need root")


def _build_store(root: Path, data: Path) -> str:
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    tiny = root / "tiny"
    (tiny / "files").mkdir(parents=True)
    (tiny / "files" / "payload").write_bytes(os.urandom(64 << 10))
    (tiny / "tiny.yaml").write_text(
        'layer: tiny\nversion: "1"\nsteps:\n  - copy: {src: ./files, dst: /srv}\n')
    return build_store([REPO / "layerspecs/busybox/busybox.yaml", tiny / "tiny.yaml"],
                       (root / "store").as_uri(), data)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    root = tmp_path_factory.mktemp("cluster")
    data = root / "data"
    data.mkdir()
    url = _build_store(root, data)
    c = make_cluster(root / "nodes", url, data, 3)
    for n in c.nodes:
        n.set_capacity(sandboxes=CAPACITY[n.name])
    try:
        yield c
    finally:
        destroy_cluster(c)


@pytest.fixture
def client(cluster: SshCluster, monkeypatch: pytest.MonkeyPatch,
           dsec_home: Path) -> Iterator[SshCluster]:
    """This test's user config lists the three nodes; the SSH side is the cluster's."""
    for k, v in cluster.client_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DSEC_STORE", cluster.store_url)
    from dsec_cli.core.config import save_user_config

    save_user_config({"nodes": cluster.config_nodes()})
    _clear(cluster, "before")
    yield cluster
    _clear(cluster, "after")


def _clear(cluster: SshCluster, when: str) -> None:
    """Tests are isolated: no sandbox of another test on any node when one starts, and none
    of its own left when it ends (removed here, then the test's teardown fails)."""
    from dsec_cli.run.cluster.registry import get_node

    left = {n.name: [r.id for r in get_node(n.name).sandboxes()] for n in cluster.nodes}
    for name, ids in left.items():
        for sid in ids:
            get_node(name).remove(sid)
    usage = {n.name: int(get_node(n.name).info()["usage"]["sandboxes"]) for n in cluster.nodes}
    assert not any(left.values()) and not any(usage.values()), \
        f"sandboxes left on the nodes {when} the test: {left}, usage {usage}"
