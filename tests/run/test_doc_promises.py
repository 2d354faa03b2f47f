"""Promises docs make of sandbox commands, checked as a user meets them: a snapshot never
moves a version the store holds (versions are immutable), `dsec ps` piped prints whole ids,
`ps --all-nodes` includes this machine's sandboxes, and without root a sandbox is refused
with a clear error before anything is made."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import IMAGE, REPO, dsec


def _refs(env: dict[str, str]) -> dict[str, str]:
    return {i["ref"]: i["digest"] for i in json.loads(dsec(env, "ls", "--json").stdout)}


def test_snapshot_does_not_move_an_existing_version(node_env: dict[str, str]) -> None:
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    try:
        dsec(node_env, "exec", sid, "--", "sh", "-c", "echo one > /root/v")
        dsec(node_env, "snapshot", sid, "--as", "promise@1")
        before = _refs(node_env)
        dsec(node_env, "exec", sid, "--", "sh", "-c", "echo two > /root/v")
        p = dsec(node_env, "snapshot", sid, "--as", "promise@1", check=2)
        err = " ".join(p.stderr.decode().split())
        assert "promise" in err and "--replace" in err and "Traceback" not in err, err
        assert _refs(node_env) == before  # neither the layer nor the image ref moved
        status = json.loads(dsec(node_env, "inspect", sid, "--json").stdout)["status"]
        assert status == "running"  # refused before the sandbox was paused
        p = dsec(node_env, "run", "promise@1", "--", "cat", "/root/v")
        assert p.stdout == b"one\n"

        dsec(node_env, "snapshot", sid, "--as", "promise@1", "--replace")
        after = _refs(node_env)
        assert after["promise@1"] != before["promise@1"]
        assert after["promise-layer@1"] != before["promise-layer@1"]
        p = dsec(node_env, "run", "promise@1", "--", "cat", "/root/v")
        assert p.stdout == b"two\n"
    finally:
        dsec(node_env, "rm", sid, check=None)


def test_ps_piped_prints_whole_ids(node_env: dict[str, str]) -> None:
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    try:
        for columns in ("40", "80"):  # narrower than the table: nothing is cut all the same
            out = dsec({**node_env, "COLUMNS": columns}, "ps").stdout.decode()
            assert "…" not in out, out
            [row] = [line for line in out.splitlines() if line.startswith(sid)]
            assert row.split()[:2] == [sid, "container"], out
            assert out.splitlines()[0].split()[0] == "ID"
        # `ls` (every table) is plain when piped too
        out = dsec({**node_env, "COLUMNS": "40"}, "ls").stdout.decode()
        assert "…" not in out and IMAGE in out.split(), out
    finally:
        dsec(node_env, "rm", sid)


def test_ps_all_nodes_lists_this_machine(node_env: dict[str, str]) -> None:
    sid = dsec(node_env, "run", "-d", IMAGE).stdout.decode().strip()
    try:
        doc = json.loads(dsec(node_env, "ps", "--all-nodes", "--json").stdout)
        assert [r["id"] for r in doc["sandboxes"]] == [sid] and doc["failed"] == []
        assert sid in dsec(node_env, "ps", "--all-nodes").stdout.decode().split()
    finally:
        dsec(node_env, "rm", sid)


SYSTEM_PYTHON = Path("/usr/bin/python3.11")  # the test venv's interpreter may be root's own


@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs Debian's python3.11")
def test_without_root_a_sandbox_is_refused_before_anything(tmp_path: Path) -> None:
    """As another user, `dsec run` says root is needed (exit 2) and leaves no row; building a
    store works as any user."""
    import shutil
    import site
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="dsec-nonroot-"))
    try:
        work.chmod(0o777)
        env = {"HOME": str(work), "PATH": "/usr/bin:/bin", "DSEC_RUNTIME_DIR": str(work / "run"),
               "PYTHONPATH": ":".join([str(REPO), *site.getsitepackages()])}
        url = (work / "store").as_uri()

        def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534",
                                   "--clear-groups", str(SYSTEM_PYTHON), "-m", "dsec_cli",
                                   *argv], capture_output=True, text=True, cwd=work, env=env,
                                  timeout=300)

        p = as_nobody("build", str(REPO / "layerspecs/busybox"), "--store", url)
        assert p.returncode == 0, p
        p = as_nobody("run", "--store", url, IMAGE, "--", "echo", "hi")
        err = " ".join(p.stderr.split())
        assert p.returncode == 2 and "needs root" in err and "Traceback" not in err, p
        assert p.stdout == ""
        p = as_nobody("ps", "--json")
        assert p.returncode == 0 and json.loads(p.stdout) == [], p
    finally:
        shutil.rmtree(work)
