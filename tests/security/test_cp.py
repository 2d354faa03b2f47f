"""`dsec cp` out of a sandbox treats what the sandbox holds as hostile, and cp and exec cost
bounded memory whatever the sandbox produces.

The sandbox (root inside) plants setuid files, FIFOs, device nodes, symlinks to the host's
root and huge sparse files, then the host copies them out; a hostile agent's records are
fed to the host's writer directly. Copies that would hold a whole file in memory run under
an address-space limit, so where the wall is missing they fail instead of pressing on the
machine. Probes write only inside their own sandbox and the test's temp dir.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.core.errors import UsageError
from dsec_cli.run.node import CreateOptions, Node
from tests.run.conftest import IMAGE, dsec

from ._sandboxes import *  # noqa: F403 - the sandbox fixtures
from ._sandboxes import dsec_measured

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

GiB = 1 << 30
MiB = 1 << 20
#: what the dsec process may use at its peak for a transfer of any size (Python, the CLI's
#: imports, a window of 1 MiB frames)
RSS_BOUND = 160 * MiB


@pytest.fixture(scope="module", params=["container", "fncall"])
def sb(request: pytest.FixtureRequest, node: Node) -> Iterator[str]:
    sid = node.create(IMAGE, CreateOptions(backend=request.param)).id
    try:
        yield sid
    finally:
        node.remove(sid)


def _sh(node: Node, sid: str, script: str) -> None:
    r = node.exec(sid, ["sh", "-c", script])
    assert r.exit_code == 0, r.stderr


def test_setuid_bits_are_dropped(sb: str, node: Node, node_env: dict[str, str],
                                 tmp_path: Path) -> None:
    _sh(node, sb, "echo '#!/bin/sh' > /tmp/suid && chmod 6755 /tmp/suid && "
                  "mkdir -p /tmp/sd && echo x > /tmp/sd/s && chmod 4711 /tmp/sd/s && "
                  "chmod 1777 /tmp/sd")
    dsec(node_env, "cp", f"{sb}:/tmp/suid", str(tmp_path / "suid"))
    mode = (tmp_path / "suid").stat().st_mode
    assert stat.S_IMODE(mode) == 0o755, oct(mode)
    dsec(node_env, "cp", f"{sb}:/tmp/sd", str(tmp_path / "sd"))
    assert stat.S_IMODE((tmp_path / "sd" / "s").stat().st_mode) == 0o711
    assert stat.S_IMODE((tmp_path / "sd").stat().st_mode) == 0o777


def test_fifo_is_refused_at_once_and_the_agent_keeps_serving(node: Node,
                                                             node_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    sid = node.create(IMAGE).id  # its own: where the wall is missing, its agent is wedged
    try:
        _sh(node, sid, "mkfifo /tmp/fifo")
        ran = dsec_measured(node_env, "cp", f"{sid}:/tmp/fifo", str(tmp_path / "f"),
                            timeout=30)
        assert not ran.timed_out and ran.returncode == 2, ran
        assert b"/tmp/fifo" in ran.stderr and b"FIFO" in ran.stderr
        assert b"Traceback" not in ran.stderr and not (tmp_path / "f").exists()
        ran = dsec_measured(node_env, "exec", sid, "--", "echo", "alive", timeout=15)
        assert (ran.returncode, ran.stdout) == (0, b"alive\n")
    finally:
        node.remove(sid)


def test_device_node_is_refused_by_type(sb: str, node: Node, node_env: dict[str, str],
                                        tmp_path: Path) -> None:
    if node.lookup(sb).backend == "fncall":
        # fncall sandboxes drop CAP_MKNOD: no device node can be made there to copy out
        r = node.exec(sb, ["sh", "-c", "mknod /tmp/dev c 1 3; echo rc=$?; ls /tmp/dev"])
        assert b"Operation not permitted" in r.stderr and b"rc=1" in r.stdout, r
        assert b"No such file" in r.stderr, r
        return
    _sh(node, sb, "mknod /tmp/dev c 1 3 && mkdir -p /tmp/withdev && echo ok > /tmp/withdev/a "
                  "&& mknod /tmp/withdev/zz c 1 5")
    p = dsec(node_env, "cp", f"{sb}:/tmp/dev", str(tmp_path / "dev"), check=2)
    assert b"/tmp/dev" in p.stderr and b"character device" in p.stderr
    # inside a directory: refused the same way, and no half-copied tree is left behind
    p = dsec(node_env, "cp", f"{sb}:/tmp/withdev", str(tmp_path / "withdev"), check=2)
    assert b"/tmp/withdev/zz" in p.stderr and b"character device" in p.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_directory_symlinks_stay_symlinks_and_nothing_escapes(sb: str, node: Node,
                                                              node_env: dict[str, str],
                                                              tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    _sh(node, sb, f"mkdir -p /tmp/d/sub && ln -s / /tmp/d/evil && ln -s {outside} /tmp/d/host "
                  "&& ln -s ../../../../.. /tmp/d/up && echo data > /tmp/d/sub/f")
    dsec(node_env, "cp", f"{sb}:/tmp/d", str(dest))
    d = dest / "d"
    assert os.readlink(d / "evil") == "/" and os.readlink(d / "host") == str(outside)
    assert os.readlink(d / "up") == "../../../../.."
    assert (d / "sub" / "f").read_bytes() == b"data\n"
    assert sorted(os.listdir(d)) == ["evil", "host", "sub", "up"]
    assert os.listdir(outside) == []
    assert sorted(os.listdir(tmp_path)) == ["dest", "outside"]


def test_hostile_records_cannot_write_outside_dest(tmp_path: Path) -> None:
    from dsec_cli.run.transfer import HostTreeWriter

    outside = tmp_path / "outside"
    outside.mkdir()
    base = tmp_path / "base"
    base.mkdir()
    attacks: list[list[tuple[str, bytes, bytes]]] = [
        [("d", b"", b""), ("f", b"../escape", b"")],
        [("d", b"", b""), ("f", b"a/../../escape", b"")],
        [("d", b"", b""), ("f", b"/abs", b"")],
        [("d", b"", b""), ("l", b"link", str(outside).encode()), ("f", b"link/escape", b"")],
        [("d", b"", b""), ("f", b"x", b""), ("f", b"x", b"")],
        [("f", b"", b""), ("f", b"escape", b"")],
    ]
    for records in attacks:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        w = HostTreeWriter(fd, ".tmp", str(base / "dest"))
        with pytest.raises(UsageError, match="the sandbox sent"):
            try:
                for kind, rel, target in records:
                    w.entry(kind, 0o755, 4, rel, target)
                    if kind == "f":
                        w.chunk(0, memoryview(b"evil"))
                w.commit("dest")
            except BaseException:
                w.abort()
                raise
            finally:
                os.close(fd)
        assert os.listdir(outside) == [] and os.listdir(base) == [], records
    assert sorted(os.listdir(tmp_path)) == ["base", "outside"]


def test_sparse_8g_copies_out_sparse_in_bounded_memory(sb: str, node: Node,
                                                       node_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    where = "/tmp" if node.lookup(sb).backend == "fncall" else "/root"
    _sh(node, sb, f"truncate -s 8G {where}/sparse && echo end >> {where}/sparse")
    ran = dsec_measured(node_env, "cp", f"{sb}:{where}/sparse", str(tmp_path / "s"),
                        timeout=90, address_space=2 * GiB)
    assert ran.returncode == 0, ran
    st = (tmp_path / "s").stat()
    assert st.st_size == 8 * GiB + 4 and st.st_blocks * 512 < 4 * MiB, st
    with open(tmp_path / "s", "rb") as f:
        f.seek(8 * GiB)
        assert f.read() == b"end\n"
    assert 0 < ran.max_rss < RSS_BOUND, ran.max_rss


def test_sparse_8g_copies_in_sparse_in_bounded_memory(sb: str, node: Node,
                                                      node_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    src = tmp_path / "s"
    with open(src, "wb") as f:
        f.truncate(8 * GiB)
        f.seek(4 * GiB)
        f.write(b"middle")
    ran = dsec_measured(node_env, "cp", str(src), f"{sb}:/tmp/in-sparse", timeout=90,
                        address_space=2 * GiB)
    assert ran.returncode == 0, ran
    assert 0 < ran.max_rss < RSS_BOUND, ran.max_rss
    r = node.exec(sb, ["sh", "-c", "stat -c '%s %b' /tmp/in-sparse; "
                                   "dd if=/tmp/in-sparse bs=1 skip=4294967296 count=6 2>/dev/null"])
    size, blocks, *_ = r.stdout.split()
    assert int(size) == 8 * GiB and int(blocks) * 512 < 4 * MiB, r.stdout
    assert r.stdout.endswith(b"middle")
    _sh(node, sb, "rm /tmp/in-sparse")


def test_exec_json_output_is_capped_in_bounded_memory(sb: str, node_env: dict[str, str]) -> None:
    ran = dsec_measured(node_env, "exec", "--json", sb, "--", "sh", "-c",
                        "head -c 314572800 /dev/zero | tr '\\0' a; echo done >&2",
                        timeout=180, address_space=2 * GiB)
    assert ran.returncode == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["stdout_truncated"] is True and doc["stderr_truncated"] is False
    assert len(doc["stdout"]) == 8 * MiB and set(doc["stdout"]) == {"a"}
    assert doc["stderr"] == "done\n"
    assert 0 < ran.max_rss < RSS_BOUND, ran.max_rss
