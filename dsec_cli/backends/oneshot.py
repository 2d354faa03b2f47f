"""One command in a root directory under bubblewrap, for build `run` steps.

The root is already assembled (an overlay mount); the command runs as root in fresh
namespaces with no network unless asked, a private /proc, /dev and /tmp-less root, and
dies with its parent. Output is streamed to a callback line by line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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
           argv: list[str]) -> subprocess.Popen[bytes]:
    """Start bwrap (``cmd``, its options) running ``argv`` with ``env``, the seccomp filter
    passed on fd ``filt`` (closed here once bwrap has it); stdout and stderr in one pipe."""
    cmd = [*cmd]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    cmd += ["--", *argv]
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(filt,))
    finally:
        os.close(filt)


def run_in_root(root: Path, argv: list[str], *, env: dict[str, str], cwd: str = "/",
                network: bool = False, on_line: Callable[[str], None] | None = None,
                timeout: float | None = None) -> int:
    """Run argv inside root; return its exit code."""
    filt = seccomp.bpf_fd()
    cmd = [bwrap_path(), "--bind", str(root), "/", "--dev", "/dev", "--proc", "/proc",
           *_rootfs.bwrap_walls(filt), "--unshare-all", "--die-with-parent", "--new-session",
           "--uid", "0", "--gid", "0", "--hostname", "dsec-build", "--clearenv", "--chdir", cwd]
    if network:
        cmd += ["--share-net"]
        # bind only over an existing file: creating a mount point would leak into the layer
        if Path("/etc/resolv.conf").exists() and (root / "etc/resolv.conf").is_file():
            cmd += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    proc = _spawn(cmd, filt, env, argv)
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
