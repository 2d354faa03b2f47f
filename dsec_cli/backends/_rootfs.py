"""Root filesystems for process sandboxes: overlay mounts of layer dirs, the small skeleton
layer that carries dsec's mount points, and the readiness handshake with the agent.

Mounting goes through libc directly (no `mount` process per sandbox); options longer than
a page fall back to mount(8) run from the common parent with relative paths.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import select
import shutil
import struct
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from ..core import files
from ..core.errors import BackendError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MNT_DETACH = 2
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 2, 4, 8, 32, 4096
CLONE_NEWNET = 0x40000000

#: mount points the skeleton layer provides, so nothing is created in a sandbox's upper dir
SKELETON_DIRS = ("proc", "sys", "dev", "tmp", ".dsec/run")
AGENT_IN_SANDBOX = "/.dsec/agent"


def shared_skeleton(root: Path) -> Path:
    """The skeleton under a node-wide directory, made once (atomically) for all sandboxes."""
    path = root / "skel-v1"
    if path.is_dir():
        return path
    tmp = root / f".skel-{os.getpid()}-{threading.get_ident()}"
    make_skeleton(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # made concurrently by another create
        if not path.is_dir():
            raise
    return path


def make_skeleton(path: Path) -> Path:
    """A tiny top lower layer holding dsec's mount points (empty dirs and one file)."""
    for d in SKELETON_DIRS:
        (path / d).mkdir(parents=True, exist_ok=True)
    (path / "tmp").chmod(0o1777)
    (path / AGENT_IN_SANDBOX.lstrip("/")).touch(mode=0o755)
    return path


def mount_overlay(target: Path, lower_dirs: Sequence[Path], upper: Path | None = None,
                  work: Path | None = None) -> None:
    """Mount an overlay at target. Without upper it is read-only (needs >= 2 lower dirs).
    lower_dirs are bottom to top (dsec's order); overlayfs wants top first."""
    target.mkdir(parents=True, exist_ok=True)
    lowers = [str(p) for p in reversed(lower_dirs)]
    opts = "lowerdir=" + ":".join(lowers)
    if upper is not None and work is not None:
        opts += f",upperdir={upper},workdir={work}"
    opts += ",index=off,xino=off"
    if len(opts) < 4000:
        rc = _libc.mount(b"overlay", str(target).encode(), b"overlay", 0, opts.encode())
        if rc == 0:
            return
        e = ctypes.get_errno()
        raise BackendError(f"cannot mount the sandbox rootfs at {target}: {os.strerror(e)}")
    # too long for one page of options: relative paths from the common parent
    common = Path(os.path.commonpath([*lowers, str(upper or target), str(target)]))
    rel = opts.replace(str(common) + "/", "")
    proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", rel, str(target)],
                          cwd=common, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"cannot mount the sandbox rootfs at {target}: {proc.stderr.strip()}")


def umount(target: Path) -> None:
    """Detach a mount (quiet when not mounted). Detaching returns at once; the kernel frees
    the overlay when its last user is gone, and a destroyed sandbox has none left."""
    if _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            raise BackendError(f"cannot unmount {target}: {os.strerror(e)}")


def mounts_under(prefix: Path) -> list[Path]:
    """Mount points below a directory (from /proc/self/mountinfo), deepest first."""
    out = []
    # mountinfo shows resolved paths: a state dir reached through a symlink must match too
    pre = os.path.realpath(prefix).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(pre):
                out.append(Path(mp))
    return sorted(out, key=lambda p: -len(p.parts))


def remove_tree(path: Path) -> None:
    """rm -rf that first unmounts anything left below, and the path itself if it is a mount
    (a sealed state dir), so it never follows into a mount. The tree is the sandbox's
    making: removed without recursion or following links (`core.files.remove_tree`)."""
    for mp in mounts_under(path):
        umount(mp)
    for _ in range(8):  # a dir may be mounted over more than once
        if not mounts_at(path):
            break
        umount(path)
    files.remove_tree(path)


def mounts_at(path: Path) -> set[Path]:
    """{path} if something is mounted exactly there, else the empty set."""
    want = os.path.realpath(path).rstrip("/")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split()[4].replace("\\040", " ") == want:
                return {path}
    return set()


def _mount(source: str | None, target: Path, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    rc = _libc.mount(source.encode() if source else None, str(target).encode(),
                     fstype.encode() if fstype else None, flags,
                     data.encode() if data else None)
    if rc != 0:
        e = ctypes.get_errno()
        raise BackendError(f"cannot mount {source or ''} at {target}: {os.strerror(e)}")


def seal_dir(path: Path) -> None:
    """Bind a sandbox's state dir onto itself with nosuid, nodev and noexec: setuid files and
    device nodes a sandbox makes in its upper or run dir are inert on the host. Inside the
    sandbox its overlay's own flags apply, so this changes nothing there."""
    _mount(str(path), path, None, MS_BIND)
    try:
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except BaseException:
        umount(path)
        raise


# -- per-sandbox disks (--disk) -------------------------------------------------------------------
LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
MIN_DISK = 16 << 20


def _mkfs(image: Path, size: int) -> None:
    with open(image, "wb") as f:
        f.truncate(size)
    # no journal and no reserved blocks: the disk dies with the sandbox, and root inside
    # must not get blocks past the limit
    proc = subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0",
                           "-E", "lazy_itable_init=1,nodiscard", str(image)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"cannot make the sandbox disk {image}: {proc.stderr.strip()}")


def _disk_template(templates: Path, size: int) -> Path:
    """An empty filesystem of `size` bytes made once per node and size (atomically)."""
    path = templates / f"ext4-{size}.img"
    if not path.exists():
        templates.mkdir(mode=0o700, exist_ok=True)
        tmp = templates / f".ext4-{size}-{os.getpid()}-{threading.get_ident()}"
        try:
            _mkfs(tmp, size)
            os.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _copy_sparse(src: Path, dst: Path) -> None:
    """Copy only src's data extents (an empty ext4 image is a few hundred KiB of them)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        size = os.fstat(fi.fileno()).st_size
        fo.truncate(size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fi.fileno(), pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(fi.fileno(), start, os.SEEK_HOLE)
            os.lseek(fo.fileno(), start, os.SEEK_SET)
            os.lseek(fi.fileno(), start, os.SEEK_SET)
            left = end - start
            while left > 0:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), left)
                if n == 0:
                    break
                left -= n
            pos = end


def make_disk(image: Path, mount_point: Path, size: int, templates: Path | None = None) -> None:
    """A sparse ext4 image of `size` bytes, loop-mounted nosuid,nodev,noexec at mount_point:
    what a sandbox may write is bounded by the filesystem's size (writes past it fail with
    ENOSPC inside), and the host filesystem only holds the blocks actually written. With
    `templates` (a node-private dir), the empty filesystem is made once per size and copied
    sparsely (a few ms) instead of running mkfs per sandbox (about 70 ms).

    The loop device is set up with autoclear, so the kernel frees it when the filesystem is
    unmounted (by destroy, or by reconcile's remove_tree after a crash): nothing to track."""
    if templates is not None:
        _copy_sparse(_disk_template(templates, size), image)
    else:
        _mkfs(image, size)
    mount_point.mkdir(exist_ok=True)
    img_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):  # another process may take the free device first
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                loop_fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                try:
                    # struct loop_config: fd, block_size, loop_info64 (lo_flags at 52), reserved
                    info = struct.pack("<QQQQQIIII64s64s32sQQ", 0, 0, 0, 0, 0, 0, 0, 0,
                                       LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
                    cfg = struct.pack("<II", img_fd, 0) + info + bytes(64)
                    try:
                        fcntl.ioctl(loop_fd, LOOP_CONFIGURE, cfg)
                    except OSError as e:
                        if e.errno == errno.EBUSY:
                            continue
                        raise BackendError(f"cannot attach the sandbox disk: {e}") from e
                    # the mount holds the device; closing loop_fd afterwards arms autoclear
                    _mount(dev, mount_point, "ext4", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                    return
                finally:
                    os.close(loop_fd)
            raise BackendError("cannot attach the sandbox disk: no free loop device")
        finally:
            os.close(ctl)
    finally:
        os.close(img_fd)


#: kernel interfaces no sandbox sees, as in Docker's default maskedPaths: they show the
#: host's keyrings (every key's description), kernel memory, timers, firmware and hardware
MASKED_PATHS = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
                "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
                "/sys/devices/virtual/powercap")


def bwrap_masks() -> list[str]:
    """bwrap arguments masking `MASKED_PATHS` over a fresh `/proc`: a file with /dev/null, a
    dir with an empty read-only tmpfs. Only the /proc ones: no bubblewrap sandbox mounts a
    sysfs. The sandbox's procfs is the host kernel's, so it has what the host's has; a path
    the kernel lacks is left out (bwrap would try to create it)."""
    args: list[str] = []
    for path in MASKED_PATHS:
        if not path.startswith("/proc/"):
            continue
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.lexists(path):
            # bound as a device (bwrap's --ro-bind adds nodev, and the file could not be
            # opened): it reads as empty, and what is written to it goes nowhere
            args += ["--dev-bind", "/dev/null", path]
    return args


def bwrap_walls(seccomp_fd: int) -> list[str]:
    """bwrap arguments every bubblewrap sandbox gets after its `--proc /proc`: sysctls
    read-only (a sandbox's root is the host's uid 0 in its user namespace, and the kernel
    lets uid 0 write most of /proc/sys without any capability), the masked kernel interfaces
    and the seccomp policy."""
    return ["--ro-bind", "/proc/sys", "/proc/sys",
            "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
            *bwrap_masks(), "--seccomp", str(seccomp_fd)]


def readable(fd: int, timeout: float) -> bool:
    """Whether fd becomes readable (or hung up) within timeout seconds. poll, not select:
    a process holding one agent connection per sandbox has fds numbered past select's 1024."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0, int(timeout * 1000))))


def wait_ready(read_fd: int, timeout: float, what: str) -> None:
    """Wait for the agent's ready byte on a pipe; EOF means it died before serving."""
    try:
        if not readable(read_fd, timeout):
            raise BackendError(f"{what}: the sandbox agent did not start within {timeout:.0f}s")
        if os.read(read_fd, 1) != b"R":
            raise BackendError(f"{what}: the sandbox agent exited before it was ready")
    finally:
        os.close(read_fd)


def loopback_up(pid: int) -> None:
    """Bring `lo` up in the network namespace of pid, from a throwaway thread (setns is
    per thread), so a network-less sandbox still has a working 127.0.0.1."""
    import socket

    err: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                ifr = struct.pack("16sH22s", b"lo", 0x1 | 0x40, b"")  # IFF_UP | IFF_RUNNING
                fcntl.ioctl(s.fileno(), 0x8914, ifr)  # SIOCSIFFLAGS
        except BaseException as e:  # reported to the caller below
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise BackendError(f"cannot bring up loopback in the sandbox: {err[0]}") from err[0]


def proc_start_time(pid: int) -> int | None:
    """The kernel start time of a process (tells a live sandbox from a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int | None, start_time: int | None) -> bool:
    if not pid:
        return False
    st = proc_start_time(pid)
    if st is None:
        return False
    if start_time is not None and st != start_time:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
