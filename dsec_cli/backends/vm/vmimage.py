"""Guest disks: the shared read-only root image of an image's layers, and the writable
per-sandbox disk whose ``upper/`` directory is the guest overlay's upper layer.

The root image is built once per image digest into a node-level cache shared by every VM
of that image: the layers are merged by a read-only overlayfs mount on the host (so
whiteouts and opaque directories resolve exactly as they would in a container), and
``mkfs.erofs`` packs the merged tree. Builders serialize on a lock file and publish with
temp + rename, so concurrent creates and crashes never expose a half-written image.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ...core.errors import BackendError, UsageError

log = logging.getLogger(__name__)

#: directories the guest init mounts over; added to every root image so that mounting
#: them never writes into the sandbox's upper layer
MOUNT_POINTS = ("proc", "sys", "dev", "tmp")
DEFAULT_DISK_SIZE = 8 << 30  # sparse: costs only what the guest writes
MIN_DISK = 16 << 20


def _run(argv: list[str], what: str) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True)
    except FileNotFoundError as e:
        raise BackendError(f"{what}: {argv[0]} is not installed",
                           hint="run scripts/setup.sh") from e
    except subprocess.CalledProcessError as e:
        err = e.stderr.decode(errors="replace").strip()
        raise BackendError(f"{what} failed: {' '.join(argv)}: {err}") from e


def image_key(lower_dirs: Sequence[Path], image_digest: str) -> str:
    """The cache key: a content digest (``sha256:...`` or bare hex) names the image as it
    is. Anything else (no digest, or a plain directory used as an image) is not
    content-addressed, so the key also covers a stat walk of the layers: an edited tree gets
    a new image."""
    # a node passes the image manifest's sha256 bare; backend callers may prefix it
    m = re.fullmatch(r"(?:sha256:)?([0-9a-f]{64})", image_digest)
    if m:
        return "sha256-" + m.group(1)
    h = hashlib.sha256(image_digest.encode() + b"\0")
    for d in lower_dirs:
        h.update(str(Path(d).resolve()).encode() + b"\0")
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames.sort()
            for name in sorted([*filenames, *dirnames]) + ["."]:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                h.update(f"{dirpath}/{name}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0"
                         .encode())
    return "tree-" + h.hexdigest()


def root_image(lower_dirs: Sequence[Path], image_digest: str, cache_dir: Path) -> Path:
    """The read-only erofs image of the merged layers, built on first use."""
    for d in lower_dirs:
        if not Path(d).is_dir():
            raise UsageError(f"rootfs layer directory {str(d)!r} does not exist")
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{image_key(lower_dirs, image_digest)}.erofs"
    if out.exists():
        return out
    with open(cache_dir / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():  # another builder finished while we waited
            return out
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{out.name}.")
        os.close(fd)
        try:
            with _merged_view(lower_dirs, cache_dir) as tree:
                _run(["mkfs.erofs", "--quiet", tmp, str(tree)], "building the VM root image")
            os.chmod(tmp, 0o444)
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    log.info("built VM root image %s", out)
    return out


class _merged_view:
    """A read-only overlayfs mount of the layers (plus a layer of mount points)."""

    def __init__(self, lower_dirs: Sequence[Path], scratch: Path) -> None:
        self.lower_dirs = [Path(d) for d in lower_dirs]
        self.scratch = scratch

    def __enter__(self) -> Path:
        self.tmp = Path(tempfile.mkdtemp(dir=self.scratch, prefix=".merge-"))
        points = self.tmp / "points"
        for name in MOUNT_POINTS:
            (points / name).mkdir(parents=True)
        (points / "tmp").chmod(0o1777)
        self.mnt = self.tmp / "merged"
        self.mnt.mkdir()
        # overlayfs lists lower dirs top first
        lowers = [str(points)] + [str(d.resolve()) for d in reversed(self.lower_dirs)]
        if os.geteuid() != 0:
            raise BackendError("building a VM root image needs root (it mounts the layers "
                               "with overlayfs to merge them)")
        _run(["mount", "-t", "overlay", "overlay", "-o", "ro,lowerdir=" + ":".join(lowers),
              str(self.mnt)], "merging the image layers")
        return self.mnt

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", str(self.mnt)], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def writable_disk(path: Path, size: int | None) -> Path:
    """A sparse ext4 disk for the sandbox's upper layer. No journal: the disk dies with
    the sandbox, and a journal-less fs can be read from the host after a guest `sync`
    without replaying anything."""
    size = size or DEFAULT_DISK_SIZE
    if size < MIN_DISK:
        raise UsageError(f"disk limit {size} bytes is too small for a VM (minimum 16 MiB)")
    with open(path, "wb") as f:
        f.truncate(size)
    _run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", "-L", "dsec-upper",
          "-E", "lazy_itable_init=1,nodiscard", str(path)], "creating the sandbox disk")
    return path


def read_upper(disk: Path, dest: Path, mount_dir: Path) -> Path:
    """Copy ``upper/`` of a (quiesced) writable disk into `dest`, in overlayfs upper
    format. Overlay bookkeeping xattrs other than opaque markers are dropped: a layer
    diff carries whiteouts and opaque directories only."""
    mount_dir.mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "ext4", "-o", "ro,loop,noexec,nodev,nosuid", str(disk),
          str(mount_dir)], "mounting the sandbox disk")
    try:
        src = mount_dir / "upper"
        dest.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            _run(["cp", "-a", f"{src}/.", str(dest)], "copying the sandbox diff")
    finally:
        subprocess.run(["umount", str(mount_dir)], capture_output=True)
    _strip_overlay_xattrs(dest)
    return dest


def _strip_overlay_xattrs(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, "."]:
            p = os.path.join(dirpath, name)
            try:
                attrs = os.listxattr(p, follow_symlinks=False)
            except OSError:
                continue
            for a in attrs:
                if a.startswith("trusted.overlay.") and a != "trusted.overlay.opaque":
                    os.removexattr(p, a, follow_symlinks=False)
