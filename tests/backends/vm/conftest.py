"""Fixtures for the VM backends: a busybox root layer, a per-session node state dir, and
the skip when the guest kernel from scripts/setup.sh is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec_cli.backends.vm.vmkernel import default_kernel_dir


def busybox_layer(dest: Path) -> Path:
    """A minimal root layer from Debian's busybox-static (what the layer cache will hand us)."""
    (dest / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", dest / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for a in applets:
        if a != "busybox":
            os.symlink("busybox", dest / "bin" / a)
    for d in ("etc", "root", "data/keep"):
        (dest / d).mkdir(parents=True)
    (dest / "etc" / "hello").write_text("hello from the base layer\n")
    (dest / "data" / "keep" / "old").write_text("old\n")
    return dest


@pytest.fixture(scope="session")
def base_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_layer(tmp_path_factory.mktemp("layer0") / "tree")


@pytest.fixture(scope="session")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vmnode")


@pytest.fixture(scope="session", autouse=True)
def _need_kernel() -> None:
    if not (default_kernel_dir() / "vmlinuz").exists() and not os.environ.get("DSEC_KERNEL"):
        pytest.skip("no guest kernel: run scripts/setup.sh")
    if os.geteuid() != 0:
        pytest.skip("VM root images are built with an overlayfs mount: needs root")
