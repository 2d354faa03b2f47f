"""Pieces of the VM backends that need no guest: module resolution, initramfs, root images."""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsec_cli.backends.vm import vmimage
from dsec_cli.backends.vm.vmkernel import (
    _has_pvh_note,
    boot_image,
    build_initramfs,
    find_kernel,
    module_load_order,
)
from dsec_cli.core.errors import UsageError


@pytest.mark.usefixtures("guest_kernel")
def test_module_order_puts_dependencies_first() -> None:
    k = find_kernel()
    if k.modules_dir is None:
        pytest.skip("monolithic kernel")
    names = [p.stem for p in module_load_order(k.modules_dir)]
    for dep, mod in [("virtio", "virtio_blk"), ("virtio_ring", "virtio_mmio"),
                     ("jbd2", "ext4"), ("crc32c_generic", "ext4")]:
        assert names.index(dep) < names.index(mod)
    assert {"overlay", "erofs", "virtio_console", "virtio_pci"} <= set(names)


@pytest.mark.usefixtures("guest_kernel")
def test_initramfs_holds_init_busybox_and_modules(tmp_path: Path) -> None:
    k = find_kernel()
    img = build_initramfs(k, tmp_path)
    assert build_initramfs(k, tmp_path) == img  # cached by content
    listing = subprocess.run(["/bin/busybox", "cpio", "-t"], stdin=img.open("rb"),
                             capture_output=True, text=True, check=True).stdout.split()
    assert {"init", "bin/busybox", "lib/modules/load-order", "lib/modules/ext4.ko"} <= set(listing)


@pytest.mark.usefixtures("guest_kernel")
def test_boot_image_is_the_uncompressed_pvh_kernel(tmp_path: Path) -> None:
    k = find_kernel()
    img = boot_image(k, tmp_path)
    if img == k.image:
        pytest.skip("this kernel has no PVH entry point; it boots as a bzImage")
    elf = img.read_bytes()
    assert elf[:4] == b"\x7fELF" and _has_pvh_note(elf)
    assert boot_image(k, tmp_path) == img  # extracted once


def test_missing_kernel_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=str(tmp_path / "k")):
        find_kernel(tmp_path / "k")


@pytest.mark.usefixtures("as_root")
def test_root_image_built_once_under_concurrency(base_layer: Path, tmp_path: Path) -> None:
    top = tmp_path / "top"
    (top / "etc").mkdir(parents=True)
    (top / "etc" / "top").write_text("t\n")
    start = threading.Barrier(3)

    def build() -> Path:
        start.wait(60)
        return vmimage.root_image((base_layer, top), "sha256:" + "c" * 64, tmp_path / "cache")

    with ThreadPoolExecutor(3) as pool:
        # .result() raises a thread's exception here, failing the test
        results = [f.result(timeout=300) for f in [pool.submit(build) for _ in range(3)]]
    assert len(results) == 3 and len(set(results)) == 1 and results[0].is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")) \
        == [results[0].name]
    assert not list((tmp_path / "cache").glob(".merge-*"))
    assert str(tmp_path) not in Path("/proc/mounts").read_text()
