"""The guest kernel and the initramfs the VM backends boot.

The default kernel is Debian's `linux-image-amd64`, unpacked (never installed) by
`scripts/setup.sh` into ``<cache>/kernel/<version>/`` with ``vmlinuz`` and ``lib/modules``.
Debian builds virtio, ext4, erofs and overlayfs as modules, so the initramfs carries the
few ``.ko`` files the guest needs (dependencies read from each module's ``.modinfo``;
the unpacked package has no ``modules.dep``), busybox-static and the guest init.
A kernel given by ``kernel:`` in the config / ``DSEC_KERNEL`` may be a bare image with those drivers
built in, or a directory laid out like the cache entry.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from ...core.errors import UsageError

#: modules the guest needs, by name; their dependencies are added from .modinfo
GUEST_MODULES = (
    "virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "virtio_net",
    "crc32c_generic", "ext4", "erofs", "overlay",
    "virtio_balloon",  # free page reporting: memory the guest frees goes back to the host
)
#: softdeps written as crypto aliases, which modinfo cannot resolve without modules.alias
_ALIASES = {"crypto-crc32c": "crc32c_generic"}

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")


def cache_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "dsec"


def default_kernel_dir() -> Path:
    return cache_home() / "kernel" / "current"


@dataclass(frozen=True)
class Kernel:
    """A bootable kernel image and, when it has them, its module tree."""

    image: Path
    modules_dir: Path | None  # lib/modules/<release>, or None for a monolithic kernel

    @property
    def release(self) -> str:
        return self.modules_dir.name if self.modules_dir else self.image.name


def find_kernel(path: str | os.PathLike[str] | None = None) -> Kernel:
    """Resolve the configured kernel (``kernel:`` / ``DSEC_KERNEL``) or the setup cache into
    a `Kernel`."""
    from ...core.config import load_config

    given = path or load_config().kernel or None
    root = Path(given) if given else default_kernel_dir()
    where = f"kernel {str(root)!r}" + ("" if given else " (the default, from scripts/setup.sh)")
    if root.is_file():
        mods = _modules_dir(root.parent.parent) if root.parent.name == "boot" else None
        return Kernel(root.resolve(), mods)
    if not root.is_dir():
        raise UsageError(f"{where} does not exist",
                         hint="run scripts/setup.sh to fetch Debian's kernel, or point "
                              "`kernel:` in the config or DSEC_KERNEL at a vmlinuz or a "
                              "kernel directory")
    images = sorted(root.glob("vmlinuz*")) + sorted(root.glob("boot/vmlinuz*"))
    if not images:
        raise UsageError(f"{where} holds no vmlinuz image")
    return Kernel(images[0].resolve(), _modules_dir(root))


def _modules_dir(root: Path) -> Path | None:
    trees = sorted(p for p in (root / "lib" / "modules").glob("*") if p.is_dir())
    return trees[-1].resolve() if trees else None


# -- boot image ------------------------------------------------------------------------------

_PAYLOADS = ((b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x1f\x8b\x08", "gzip"))


def _decompress(data: bytes, kind: str) -> bytes:
    if kind == "xz":
        import lzma

        return lzma.LZMADecompressor().decompress(data)
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)

    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)


def _has_pvh_note(elf: bytes) -> bool:
    """True if the ELF kernel carries XEN_ELFNOTE_PHYS32_ENTRY, which QEMU's PVH loader
    needs to enter it directly in 32-bit mode."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return False
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf,
                                                                 phoff + i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, off)
            name = elf[off + 12:off + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == 18:
                return True
            off += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
    return False


def boot_image(kernel: Kernel, cache_dir: Path) -> Path:
    """The image QEMU should load: the uncompressed ELF kernel when it supports PVH entry
    (QEMU then loads it straight into guest memory), else the bzImage as it is.
    Under TCG, inflating an 8 MB xz bzImage inside the guest takes most of the boot
    (14 s -> 4.5 s to userspace for Debian's kernel on microvm here)."""
    st = kernel.image.stat()
    key = hashlib.sha256(f"{kernel.image}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_dir / f"vmlinux-{key[:24]}"
    skip = cache_dir / f"vmlinux-{key[:24]}.none"
    if out.exists():
        return out
    if skip.exists():
        return kernel.image
    data = kernel.image.read_bytes()
    elf = b""
    if data[:4] == b"\x7fELF":
        return kernel.image
    for magic, kind in _PAYLOADS:
        i = data.find(magic)
        if i >= 0:
            try:
                elf = _decompress(data[i:], kind)
            except Exception:  # noqa: BLE001 - not this payload; the bzImage still boots
                elf = b""
            if elf[:4] == b"\x7fELF":
                break
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not _has_pvh_note(elf):
        skip.touch()
        return kernel.image
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".vmlinux-")
    with os.fdopen(fd, "wb") as f:
        f.write(elf)
    os.replace(tmp, out)
    return out


# -- modules ---------------------------------------------------------------------------------

def _modinfo(ko: Path) -> tuple[list[str], list[str]]:
    """(depends, pre-softdeps) from a module's .modinfo strings."""
    data = ko.read_bytes()
    deps: list[str] = []
    soft: list[str] = []
    m = re.search(rb"\0depends=([^\0]*)\0", data)
    if m and m.group(1):
        deps = m.group(1).decode().split(",")
    for s in re.findall(rb"\0softdep=pre: ([^\0]*)\0", data):
        soft += s.decode().split()
    return deps, soft


def module_load_order(modules_dir: Path, wanted: tuple[str, ...] = GUEST_MODULES) -> list[Path]:
    """The .ko files for `wanted` and their dependencies, dependencies first.
    Modules the kernel has built in (modules.builtin) or lacks are skipped."""
    index: dict[str, Path] = {}
    for ko in (modules_dir / "kernel").rglob("*.ko"):
        index[ko.stem.replace("-", "_")] = ko
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        name = _ALIASES.get(name, name).replace("-", "_")
        if name in seen or name not in index:
            return
        seen.add(name)
        deps, soft = _modinfo(index[name])
        for d in soft + deps:
            visit(d)
        order.append(index[name])

    for name in wanted:
        visit(name)
    return order


# -- initramfs -------------------------------------------------------------------------------

class _Cpio:
    """A minimal writer for the newc cpio format the kernel unpacks as initramfs."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
               ) -> None:
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(name) + 1, 0]
        hdr = b"070701" + b"".join(b"%08X" % f for f in fields)
        self.ino += 1
        buf = hdr + name.encode() + b"\0"
        buf += b"\0" * (-len(buf) % 4)
        buf += data + b"\0" * (-len(data) % 4)
        self.out.write(buf)

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def trailer(self) -> None:
        self._entry("TRAILER!!!", 0)


def busybox_path() -> Path:
    for c in BUSYBOX_CANDIDATES:
        p = Path(c)
        if p.is_file() and b"/lib64/ld-linux" not in p.read_bytes()[:4096]:
            return p
    raise UsageError("a static busybox is needed for the guest initramfs",
                     hint="install Debian's busybox-static (scripts/setup.sh does)")


def guest_file(name: str) -> bytes:
    return resources.files("dsec_cli.backends.vm.guest").joinpath(name).read_bytes()


def build_initramfs(kernel: Kernel, cache_dir: Path, *, agent: Path | None = None,
                    init: str = "init.sh") -> Path:
    """The initramfs for `kernel` (cached by content of its inputs): busybox, the needed
    modules in load order, the guest init and, when given, the exec agent."""
    mods = module_load_order(kernel.modules_dir) if kernel.modules_dir else []
    bb = busybox_path()
    init_bytes = guest_file(init)
    h = hashlib.sha256(b"dsec-initramfs-2\0")
    for p in [bb, *mods, *([agent] if agent else [])]:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(init_bytes)
    out = cache_dir / f"initramfs-{h.hexdigest()[:24]}.cpio"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".initramfs-")
    try:
        with os.fdopen(fd, "wb") as f:
            c = _Cpio(f)
            for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules", "mnt", "mnt/lower",
                      "mnt/disk", "newroot", "etc", "tmp"):
                c.dir(d)
            # the kernel opens /dev/console for init's stdio before anything is mounted
            c.chardev("dev/console", 5, 1)
            c.file("bin/busybox", bb.read_bytes(), 0o755)
            c.symlink("bin/sh", "busybox")
            c.file("init", init_bytes, 0o755)
            names = []
            for ko in mods:
                c.file(f"lib/modules/{ko.name}", ko.read_bytes())
                names.append(ko.name)
            c.file("lib/modules/load-order", ("\n".join(names) + "\n").encode())
            if agent:
                c.file("bin/dsec-agent", agent.read_bytes(), 0o755)
            c.trailer()
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out

