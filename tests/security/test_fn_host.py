"""A function sandbox sees what it runs on, never the host's other files or keys: a
`FunctionPool` worker gets the host's interpreter, stdlib and importable code, a generated
/etc and nothing of the host's secrets; an fncall sandbox gets its image. No bubblewrap
sandbox (pool worker, fncall, build step) or container lists the host's keyrings or reads
the kernel interfaces Docker masks.

The probes only read: files are compared by their sha256 (a host secret is never printed),
canaries live under the test's tmp_path, and the one kernel key the test adds to its own
session keyring has a random description and is invalidated afterwards.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import secrets
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from dsec_cli.api.sandboxes import Sandbox
from dsec_cli.backends.fnpool import FunctionPool
from tests.run.conftest import (  # noqa: F401  (fixtures)
    IMAGE,
    dsec_home,
    node_env,
    sandbox_data,
    store_url,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

#: Docker's default maskedPaths, written out here as the reference the code must meet
DOCKER_MASKED = ["/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys",
                 "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                 "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
                 "/sys/devices/virtual/powercap"]

#: a module the function runs from, in a dir of the import path that also holds secrets (a
#: home dir, a project root): the worker must import it and see nothing else of the dir
PROBE_MODULE = '''
import hashlib, os

def digests(paths):
    """sha256 of each path the sandbox can read, "unreadable" or None where it sees none."""
    out = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            out[p] = "unreadable" if os.path.lexists(p) else None
    return out

def writable(path):
    try:
        with open(path, "x"):
            return True
    except OSError:
        return False
'''

_KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
KEY_SPEC_SESSION_KEYRING, KEYCTL_INVALIDATE = -3, 21


@pytest.fixture
def host_key() -> Iterator[str]:
    """A key in this process's session keyring (which every sandbox started from here
    inherits), named at random: the description a sandbox must not find in /proc/keys."""
    if platform.machine() not in _KEY_SYSCALLS:
        pytest.skip(f"no keyring syscall numbers for {platform.machine()}")
    add_key, keyctl = _KEY_SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    desc = f"dsec-fn-host-{secrets.token_hex(8)}"
    key = libc.syscall(add_key, b"user", desc.encode(), b"x", 1, KEY_SPEC_SESSION_KEYRING)
    assert key > 0, os.strerror(ctypes.get_errno())
    try:
        assert desc in Path("/proc/keys").read_text()  # what an unmasked /proc/keys shows
        yield desc
    finally:
        libc.syscall(keyctl, KEYCTL_INVALIDATE, key)


def _host_secrets() -> dict[str, str]:
    """sha256 of every regular file of the host's /etc that others may not read
    (/etc/shadow, SSH host keys, TLS private keys...)."""
    out = {}
    for top, _, names in os.walk("/etc"):
        for name in names:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and not st.st_mode & stat.S_IROTH:
                out[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert "/etc/shadow" in out  # the probe has something to find (and the host's SSH keys)
    return out


def _masked_probe(paths: list[str]) -> str:
    """A shell line printing, for each path, its size (a file) or entry count (a dir)."""
    return "; ".join(f'if [ -d {p} ]; then echo "{p} $(ls -A {p} | wc -l)"; '
                     f'elif [ -e {p} ]; then echo "{p} $(wc -c < {p})"; fi' for p in paths)


def _check_masked(out: bytes) -> None:
    """Every Docker-masked path that exists on the host reads as empty inside (a /sys one
    may be absent: bubblewrap sandboxes mount no sysfs; every procfs has the /proc ones)."""
    seen = dict(line.split() for line in out.decode().splitlines())
    host = [p for p in DOCKER_MASKED if os.path.lexists(p)]
    shown = {p: seen.get(p) for p in host
             if seen.get(p) != "0" and not (p.startswith("/sys/") and p not in seen)}
    assert shown == {}


def _probe_line(desc: str) -> list[str]:
    return ["sh", "-c", f"grep -c {desc} /proc/keys; {_masked_probe(DOCKER_MASKED)}"]


def _keys_unlisted(out: bytes) -> bytes:
    """The first line of a probe's output is grep's count of the key in /proc/keys."""
    count, _, rest = out.partition(b"\n")
    assert count == b"0"
    return rest


@pytest.fixture
def home_on_path(tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, ModuleType]]:
    """A dir on the import path holding the probe module beside an SSH key and a notes
    file (canaries with random content)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh/id_ed25519").write_text(secrets.token_hex(32))
    (home / "notes.txt").write_text(secrets.token_hex(32))
    (home / "fn_host_probe.py").write_text(PROBE_MODULE)
    monkeypatch.syspath_prepend(str(home))
    import fn_host_probe  # type: ignore[import-not-found]

    yield home, fn_host_probe
    sys.modules.pop("fn_host_probe", None)


def test_pool_function_sees_no_host_file_or_secret(
        home_on_path: tuple[Path, ModuleType]) -> None:
    home, probe = home_on_path
    host = _host_secrets()
    canaries = [str(home / ".ssh/id_ed25519"), str(home / "notes.txt")]
    with FunctionPool(1, cgroup_parent=None) as pool:
        seen = pool.call(probe.digests, [*host, *canaries], timeout=60)
        etc_writable = pool.call(probe.writable, "/etc/ld.so.preload", timeout=60)
        code = "import ssl, json, getpass; ssl.create_default_context(); print(getpass.getuser())"
        r = pool.run([os.path.realpath(sys.executable), "-c", code], timeout=60)
    assert {p: d for p, d in seen.items() if d is not None} == {}
    assert not etc_writable  # nor can a call leave a file there for the next one
    assert (r.exit_code, r.stdout) == (0, b"root\n"), r.stderr  # what the interpreter needs


def test_pool_lists_no_host_key_and_masks_kernel_interfaces(host_key: str) -> None:
    with FunctionPool(1, cgroup_parent=None) as pool:
        r = pool.run(_probe_line(host_key), timeout=60)
    _check_masked(_keys_unlisted(r.stdout))


def test_build_step_lists_no_host_key(host_key: str, tmp_path: Path) -> None:
    from dsec_cli.backends.oneshot import run_in_root

    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed")
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    shutil.copy(busybox, root / "bin/busybox")
    lines: list[str] = []
    argv = ["/bin/busybox", *_probe_line(host_key)]
    rc = run_in_root(root, argv, env={"PATH": "/bin"}, on_line=lines.append, timeout=60)
    assert rc == 0, lines
    _check_masked(_keys_unlisted("\n".join(lines).encode()))


@pytest.mark.parametrize("backend", ["fncall", "container"])
def test_sandbox_sees_its_image_not_the_hosts_secrets_or_keys(
        backend: str, host_key: str, node_env: dict[str, str]) -> None:  # noqa: F811
    host = _host_secrets()
    with Sandbox.create(IMAGE, backend=backend, network="none") as sb:
        r = sb.exec(_probe_line(host_key), timeout=60)
        _check_masked(_keys_unlisted(r.stdout))
        r = sb.exec(["sh", "-c", "sha256sum " + " ".join(host) + " 2>/dev/null; true"],
                    timeout=60)
        inside = {line.split()[1]: line.split()[0] for line in r.stdout.decode().splitlines()}
        assert {p for p, d in host.items() if inside.get(p) == d} == set()
        if backend == "container":  # what runc was told, including paths this host lacks
            config = Path(node_env["DSEC_STATE_DIR"], "sandboxes", sb.id, "config.json")
            masked = json.loads(config.read_text())["linux"]["maskedPaths"]
            assert set(DOCKER_MASKED) - set(masked) == set()
