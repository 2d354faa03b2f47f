"""Fixtures for the VM backends: a busybox root layer, a per-session node state dir, and
the skips when the guest kernel from scripts/setup.sh is missing or the tests are not root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec_cli.backends.vm.vmkernel import default_kernel_dir
from tests.backends.layers import busybox_layer


@pytest.fixture(scope="session")
def base_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return busybox_layer(tmp_path_factory.mktemp("layer0") / "tree")


@pytest.fixture(scope="session")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vmnode")


@pytest.fixture(scope="session")
def guest_kernel() -> None:
    """Skips a test that needs the guest kernel when it is missing (tests that need none, such
    as the missing-kernel error, do not ask for this)."""
    if not (default_kernel_dir() / "vmlinuz").exists() and not os.environ.get("DSEC_KERNEL"):
        pytest.skip("no guest kernel: run scripts/setup.sh")


@pytest.fixture(scope="session")
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("VM root images are built with an overlayfs mount: needs root")
