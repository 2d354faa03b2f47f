"""`dsec run --fetch lazy|background` with the container backend on lazy lower dirs, the
statistics `dsec ps --json` reports, cleanup with the sandbox and after `kill -9`, profiled
prefetch with `dsec optimize`, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .conftest import Published


def dsec(env: dict[str, str], *args: str, check: int | None = 0, timeout: float = 300
         ) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("dsec")
    p = subprocess.run([str(exe), *args], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=timeout)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


@contextmanager
def sandbox(env: dict[str, str], *args: str) -> Iterator[str]:
    """A detached sandbox, removed however the test ends."""
    sid = dsec(env, "run", "-d", *args).stdout.strip()
    try:
        yield sid
    finally:
        dsec(env, "rm", sid, check=None)


def lazy_mounts(state: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f
                if line.split()[4].startswith(state) and " fuse.dsec " in line]


def daemons(state: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"dsec_cli.run.lazy.mountd" in cmd and any(state.encode() in c for c in cmd):
                out.append(int(p.name))
    return out


def test_container_runs_on_lazy_lower_dirs(node_env: dict[str, str],
                                           s3_image: Published) -> None:
    p = dsec(node_env, "run", "--fetch", "lazy", s3_image.image, "--",
             "sh", "-c", "hello; cat /etc/small.conf; cat /data/rel-link; ls /opaque; "
             "test -e /data/gone || echo whiteout-hides")
    want = (s3_image.tree / "etc/small.conf").read_text()
    assert p.stdout == "hello from a lazy layer\n" + want * 2 + "kept\nwhiteout-hides\n"
    state = node_env["DSEC_STATE_DIR"]
    assert lazy_mounts(state) == [] and daemons(state) == []


def test_detached_lazy_sandbox_reports_fetch_stats(node_env: dict[str, str],
                                                   s3_image: Published) -> None:
    state = node_env["DSEC_STATE_DIR"]
    with sandbox(node_env, "--fetch", "lazy", s3_image.image) as sid:
        fetch = _stats_after_read(node_env, sid, s3_image)
    assert fetch["mode"] == "lazy"
    assert fetch["bytes_served"] >= 3 << 20
    assert fetch["bytes_fetched"] + fetch["bytes_from_cache"] > 0
    # the first read of each chunk waited on the store
    assert fetch["stall_seconds"] > 0 if fetch["bytes_fetched"] else fetch["stall_seconds"] >= 0
    assert lazy_mounts(state) == [] and daemons(state) == []


def _stats_after_read(node_env: dict[str, str], sid: str, s3_image: Published) -> dict:
    assert len(lazy_mounts(node_env["DSEC_STATE_DIR"])) == 1
    out = dsec(node_env, "exec", sid, "--", "md5sum", "/big/blob0.bin").stdout
    import hashlib

    assert out.split()[0] == hashlib.md5((s3_image.tree / "big/blob0.bin").read_bytes()
                                         ).hexdigest()
    deadline = time.monotonic() + 30
    while True:  # statistics are flushed ten times a second
        rec = next(r for r in json.loads(dsec(node_env, "ps", "--json").stdout)
                   if r["id"] == sid)
        if rec["fetch"]["bytes_served"] >= 3 << 20 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert rec["fetch"]["bytes_served"] >= 3 << 20, rec  # the read reached the statistics
    return rec["fetch"]  # type: ignore[no-any-return]


def test_mount_cleaned_after_kill9_of_dsec(node_env: dict[str, str],
                                           s3_image: Published) -> None:
    state = node_env["DSEC_STATE_DIR"]
    exe = Path(sys.executable).with_name("dsec")
    proc = subprocess.Popen([str(exe), "run", "--fetch", "lazy", s3_image.image, "--",
                             "sleep", "600"], env={**os.environ, **node_env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not lazy_mounts(state) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert lazy_mounts(state)
    proc.send_signal(signal.SIGKILL)  # during create or while the command runs
    proc.wait()
    # whatever the kill interrupted, reconcile and removing what is left leave nothing
    for r in json.loads(dsec(node_env, "ps", "--json").stdout):
        dsec(node_env, "rm", r["id"])
    assert lazy_mounts(state) == [] and daemons(state) == []


def test_daemon_killed_mount_is_removed_without_hanging(node_env: dict[str, str],
                                                        s3_image: Published) -> None:
    state = node_env["DSEC_STATE_DIR"]
    with sandbox(node_env, "--fetch", "lazy", s3_image.image) as sid:
        for pid in daemons(state):
            os.kill(pid, signal.SIGKILL)
        # the layer is gone: an error, not a hang (a generous bound; a hang would be forever)
        p = dsec(node_env, "exec", sid, "--", "cat", "/big/blob1.bin", check=None, timeout=60)
        assert p.returncode != 0 and "Transport endpoint is not connected" in p.stderr, p
    assert lazy_mounts(state) == [] and daemons(state) == []


def test_background_fetches_every_chunk(node_env: dict[str, str], s3_image: Published,
                                        tmp_path: Path) -> None:
    env = {**node_env, "DSEC_STATE_DIR": str(tmp_path / "bgnode")}  # an empty chunk cache
    with sandbox(env, "--fetch", "background", s3_image.image) as sid:
        _background(env, sid, s3_image)


def _background(env: dict[str, str], sid: str, s3_image: Published) -> None:
    deadline = time.monotonic() + 120
    while True:
        rec = json.loads(dsec(env, "ps", "--json").stdout)[0]
        if rec["fetch"]["background_done"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert rec["fetch"]["background_done"]
    from dsec_cli.push.materialize import resolve_image
    from dsec_cli.push.stores import open_store

    with open_store(s3_image.url) as st:
        stored = sum(m.stored_size for _, m in resolve_image(st, s3_image.image).layers)
    assert rec["fetch"]["bytes_fetched"] >= stored
    # everything is local now: the whole tree reads with no further request
    dsec(env, "exec", sid, "--", "sh", "-c", "cat /big/* /data/*.bin /data/*.txt >/dev/null")
    before = rec["fetch"]["requests"]
    for _ in range(50):
        after = json.loads(dsec(env, "ps", "--json").stdout)[0]["fetch"]
        if after["bytes_served"] >= 9 << 20:  # the reads above, flushed
            break
        time.sleep(0.2)
    assert after["requests"] == before


def test_optimize_writes_prefetch_list_that_mounts_honour(node_env: dict[str, str],
                                                          s3_image: Published,
                                                          tmp_path: Path) -> None:
    env = {**node_env, "DSEC_STATE_DIR": str(tmp_path / "optnode")}
    out = json.loads(dsec(env, "optimize", "--json", s3_image.image, "--",
                          "sh", "-c", "cat /big/blob1.bin /etc/small.conf >/dev/null").stdout)
    assert out["image"] == "lazyimg@1-opt"
    top = out["layers"][-1]
    assert top["layer"] == "lazytest@1-opt" and top["prefetch"] >= 2
    listed = sum(layer["prefetch"] for layer in out["layers"])  # busybox's sh is listed too
    from dsec_cli.push.dedup import load_index
    from dsec_cli.push.materialize import resolve_image
    from dsec_cli.push.stores import open_store

    with open_store(s3_image.url) as st:
        img = resolve_image(st, "lazyimg@1-opt")
        old = resolve_image(st, s3_image.image)
        index = load_index(st, img.layers[-1][1].index or "")
        assert img.layers[-1][1].content_digest == old.layers[-1][1].content_digest
    assert "big/blob1.bin" in index.prefetch and "etc/small.conf" in index.prefetch
    assert "big/blob0.bin" not in index.prefetch

    # a fresh node: the mount prefetches the list before anyone reads
    env2 = {**node_env, "DSEC_STATE_DIR": str(tmp_path / "fresh")}
    with sandbox(env2, "--fetch", "lazy", "lazyimg@1-opt") as sid:
        deadline = time.monotonic() + 60
        while True:
            f = json.loads(dsec(env2, "ps", "--json").stdout)[0]["fetch"]
            if f["prefetched_files"] >= listed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert f["prefetched_files"] == listed
        time.sleep(1)  # let the last statistics land (compared below, not timed)
        requests = json.loads(dsec(env2, "ps", "--json").stdout)[0]["fetch"]["requests"]
        dsec(env2, "exec", sid, "--", "sh", "-c", "cat /big/blob1.bin /etc/small.conf >/dev/null")
        f = json.loads(dsec(env2, "ps", "--json").stdout)[0]["fetch"]
        assert f["requests"] == requests


def test_bad_input(node_env: dict[str, str], s3_image: Published, tmp_path: Path) -> None:
    from dsec_cli.format.refs import list_refs
    from dsec_cli.push.stores import open_store

    with open_store(s3_image.url) as st:
        refs_before = sorted(r.ref for r in list_refs(st))
    p = dsec(node_env, "run", "--fetch", "sometimes", s3_image.image, "--", "true", check=2)
    assert "--fetch" in p.stderr
    env = {**node_env, "DSEC_STATE_DIR": str(tmp_path / "empty")}
    p = dsec(env, "optimize", s3_image.image, check=2)
    assert "no access profile" in p.stderr
    p = dsec(env, "optimize", s3_image.image, "--as", "bad name", check=2)
    assert "bad name" in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = dsec(env, "optimize", "nosuch@1", check=2)
    assert "nosuch@1" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # none of them wrote to the store: its refs are what they were
    with open_store(s3_image.url) as st:
        assert sorted(r.ref for r in list_refs(st)) == refs_before


#: runs a command in a private mount namespace whose /dev has the usual nodes but no fuse
NO_FUSE = """set -e
mkdir -p "$T/olddev"
mount --bind /dev "$T/olddev"
mount -t tmpfs -o mode=755 nodev /dev
for d in null zero full random urandom tty; do
  touch /dev/$d; mount --bind "$T/olddev/$d" /dev/$d
done
mkdir /dev/pts /dev/shm
mount --bind "$T/olddev/pts" /dev/pts
mount --bind "$T/olddev/shm" /dev/shm
umount -l "$T/olddev"
test ! -e /dev/fuse
exec "$@"
"""


def test_lazy_falls_back_to_eager_without_fuse(node_env: dict[str, str],
                                               s3_image: Published, tmp_path: Path) -> None:
    """docs/lazy.md: where lazy mounts are impossible (here: no /dev/fuse, in a private mount
    namespace), --fetch lazy warns and runs the image eagerly, with the same files."""
    env = {**node_env, "DSEC_STATE_DIR": str(tmp_path / "node"), "T": str(tmp_path)}
    exe = str(Path(sys.executable).with_name("dsec"))
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", NO_FUSE,
                        "sh", exe, "run", "--fetch", "lazy", "--json", s3_image.image, "--",
                        "cat", "/etc/small.conf"], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300)
    assert p.returncode == 0, p
    assert "--fetch lazy is not possible here (/dev/fuse does not exist)" in p.stderr, p.stderr
    doc = json.loads(p.stdout)
    assert doc["stdout"] == (s3_image.tree / "etc/small.conf").read_text()
    state = str(tmp_path / "node")
    assert lazy_mounts(state) == [] and daemons(state) == []
    from tests.run.conftest import leaks

    assert leaks(state) == {"mounts": [], "cgroups": [], "dirs": []}
