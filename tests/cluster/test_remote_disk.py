"""`--disk` crosses the cluster wire: a remote node bounds what its sandbox writes."""

from __future__ import annotations

from .conftest import IMAGE
from .sshnodes import SshCluster


def test_disk_limit_reaches_the_remote_node(client: SshCluster, run_dsec) -> None:  # type: ignore[no-untyped-def]
    p = run_dsec("run", "--node", "node1", "--disk", "16M", IMAGE, "--", "sh", "-c",
                 "dd if=/dev/zero of=/fill bs=1M count=32; echo rc=$?", check=False)
    assert "rc=1" in p.stdout and "No space left on device" in p.stderr, (p.stdout, p.stderr)
