"""One command in a root directory under bubblewrap, for build `run` steps.

The root is already assembled (an overlay mount); the command runs as root in fresh
namespaces with no network unless asked, a private /proc, /dev and /tmp-less root, and
dies with its parent. Output is streamed to a callback line by line.

Its user namespace maps every id (0 to 2^32-2) to the same id outside, as Docker's build
containers see them: a package that adds a user and chowns files to it, or apt dropping
to its `_apt` sandbox user (setgroups), works, and the owners it writes are the owners the
layer records. bubblewrap alone maps only the caller's id, so the namespace is made here
(`_full_userns`) and handed to bwrap with `--userns`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..core.errors import BackendError
from . import _rootfs, seccomp


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise BackendError("bubblewrap (bwrap) is not installed",
                           hint="apt-get install bubblewrap, or run scripts/setup.sh")
    return path


def _spawn(cmd: list[str], filt: int, env: dict[str, str],
           argv: list[str], more_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start bwrap (``cmd``, its options) running ``argv`` with ``env``, the seccomp filter
    passed on fd ``filt`` (closed here once bwrap has it); stdout and stderr in one pipe."""
    cmd = [*cmd]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    cmd += ["--", *argv]
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(filt, *more_fds))
    finally:
        os.close(filt)


#: ids a build sandbox maps: all of them but (uid_t)-1
ID_COUNT = 2**32 - 1


def _full_userns() -> int:
    """An fd of a new user namespace mapping every id to itself (the caller is root). A
    child is started in it only long enough for its maps to be written: the fd keeps the
    namespace alive for bwrap's `--userns`."""
    holder = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "read x"],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        ns = f"/proc/{holder.pid}/ns/user"
        deadline = time.monotonic() + 10
        own = os.stat("/proc/self/ns/user").st_ino
        while os.stat(ns).st_ino == own:  # until unshare has made its namespace
            if holder.poll() is not None or time.monotonic() > deadline:
                raise BackendError("cannot make the build sandbox's user namespace",
                                   hint="`run` steps need unshare (util-linux) and root")
            time.sleep(0.001)
        fd = os.open(ns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{holder.pid}/{name}", "w") as f:
                    f.write(f"0 0 {ID_COUNT}\n")
        except OSError as e:
            os.close(fd)
            raise BackendError(f"cannot map ids in the build sandbox: {e.strerror}") from e
        return fd
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()


def run_in_root(root: Path, argv: list[str], *, env: dict[str, str], cwd: str = "/",
                network: bool = False, egress: list[str] | None = None,
                on_line: Callable[[str], None] | None = None,
                timeout: float | None = None) -> int:
    """Run argv inside root as its root; return its exit code. Root maps every id (see
    the module's docstring); anyone else gets bwrap's own one-id namespace. ``network``:
    the host's network, or with ``egress`` (HOST:PORT rules) a network namespace of its own
    that reaches only those (`egress.scoped`), its names pinned in a read-only /etc/hosts
    bound over the root's."""
    if network and egress is not None:
        from . import egress as allowlist

        with tempfile.TemporaryDirectory(prefix="dsec-build-egress-") as tmp, \
                allowlist.scoped("build", egress, Path(tmp)) as state:
            binds: list[str] = []
            hosts = root / "etc/hosts"
            # over an existing file only (no mount point made in the layer), and never one a
            # symlink of the root leads to outside it
            if not (root / "etc").is_symlink() and hosts.is_file() and not hosts.is_symlink():
                pinned = Path(tmp, "hosts")
                pinned.write_bytes(allowlist.hosts_file(hosts.read_bytes(), state["pins"]))
                binds = ["--ro-bind", str(pinned), "/etc/hosts"]
            return _run_bwrap(root, argv, env, cwd, on_line, timeout, binds,
                              allowlist.netns_argv(state["sandbox_id"]))
    binds = []
    if network:
        # bind only over an existing file: creating a mount point would leak into the layer
        if Path("/etc/resolv.conf").exists() and (root / "etc/resolv.conf").is_file():
            binds = ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    return _run_bwrap(root, argv, env, cwd, on_line, timeout, binds, None if network else [])


def _run_bwrap(root: Path, argv: list[str], env: dict[str, str], cwd: str,
               on_line: Callable[[str], None] | None, timeout: float | None,
               binds: list[str], netns: list[str] | None) -> int:
    """bwrap over ``root``; ``netns``: ``[]`` a new empty network namespace, ``None`` the
    caller's, else the prefix (nsenter) that puts bwrap in one made for it."""
    filt = seccomp.bpf_fd()
    userns = _full_userns() if os.geteuid() == 0 else -1
    ids = (["--userns", str(userns)] if userns >= 0 else ["--unshare-user"])
    cmd = [bwrap_path(), *ids, "--bind", str(root), "/", "--dev", "/dev", "--proc", "/proc",
           *_rootfs.bwrap_walls(filt), "--unshare-ipc", "--unshare-pid", "--unshare-net",
           "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
           "--uid", "0", "--gid", "0", "--hostname", "dsec-build", "--clearenv",
           "--chdir", cwd, *binds]
    if netns is None or netns:
        cmd.remove("--unshare-net")
    if netns:
        cmd = [*netns, *cmd]
    try:
        proc = _spawn(cmd, filt, env, argv, (userns,) if userns >= 0 else ())
    finally:
        if userns >= 0:
            os.close(userns)
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            if on_line:
                on_line(raw.decode("utf-8", "replace").rstrip("\n"))
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return 124
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


#: host directories a host tool (git) needs; everything else of the host stays out of view
_HOST_TOOL_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc/alternatives")


def run_host_tool(argv: list[str], *, binds: dict[Path, str], env: dict[str, str],
                  timeout: float | None = None) -> tuple[int, str]:
    """Run one of the host's own tools (e.g. git) over an untrusted directory: the host's
    /usr read-only, only ``binds`` (host dir -> path inside) writable, no network, no /etc,
    no home, fresh namespaces and the seccomp policy. What the directory holds (a git
    config naming commands, symlinks out of it) then reaches nothing of the host.
    Returns the exit code and the combined output."""
    filt = seccomp.bpf_fd()
    cmd = [bwrap_path()]
    for d in _HOST_TOOL_DIRS:
        cmd += ["--ro-bind-try", d, d]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            *_rootfs.bwrap_walls(filt), "--unshare-all", "--die-with-parent", "--new-session",
            "--clearenv", "--chdir", "/tmp"]
    for host, inside in binds.items():
        cmd += ["--bind", str(host), inside]
    proc = _spawn(cmd, filt, env, argv)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return 124, out.decode("utf-8", "replace")
    return proc.returncode, out.decode("utf-8", "replace")
