"""What the README and docs/format.md promise of builds, checked through the real `dsec`:
extract reads .tar, .tar.gz, .tar.xz and .tar.zst alike and turns OCI whiteouts into
whiteouts; `run` steps have no network unless they ask; the store is chosen by `--store`,
`DSEC_STORE`, `./dsec.yaml` and the user config, in that order."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

from ..treecmp import assert_same_tree
from .conftest import make_tree, write_spec


def _no_xattrs(root: Path) -> Path:
    """Python's tarfile writes no xattrs: the tree to compare with has none either."""
    for p in [root, *root.rglob("*")]:
        for name in os.listxattr(p, follow_symlinks=False):
            os.removexattr(p, name, follow_symlinks=False)
    return root


def _tar_bytes(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in sorted(root.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(root)), recursive=False)
    return buf.getvalue()


def _compress(raw: bytes, fmt: str) -> bytes:
    if fmt == "tar":
        return raw
    if fmt == "tar.gz":
        import gzip

        return gzip.compress(raw)
    if fmt == "tar.xz":
        import lzma

        return lzma.compress(raw)
    return zstandard.ZstdCompressor().compress(raw)


@pytest.mark.parametrize("fmt", ["tar", "tar.gz", "tar.xz", "tar.zst"])
def test_extract_reads_every_compression(fmt: str, tmp_path: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    src = _no_xattrs(make_tree(tmp_path / "src", owners=False))
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / f"t.{fmt}").write_bytes(_compress(_tar_bytes(src), fmt))
    write_spec(folder, "x", f'layer: x\nversion: "1"\nsteps:\n'
               f"  - extract: {{src: ./t.{fmt}, dst: /opt}}\n")
    store = str(tmp_path / "store")
    run_dsec("build", str(folder), "--store", store)
    run_dsec("export", "x@1", str(tmp_path / "out"), "--store", store)
    assert_same_tree(src, tmp_path / "out" / "opt", mtimes=False, root_meta=False)


def test_extract_turns_oci_whiteouts_into_whiteouts(tmp_path: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "specs"
    base = folder / "base"
    for rel in ("a/x", "a/y", "d/k", "d/sub/deep"):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(rel)
    top = tmp_path / "top"
    (top / "a").mkdir(parents=True)
    (top / "a" / ".wh.x").write_text("")  # OCI: hides a/x below
    (top / "d").mkdir()
    (top / "d" / ".wh..wh..opq").write_text("")  # OCI: hides everything below d/
    (top / "d" / "new").write_text("new")
    (folder / "top.tar.gz").write_bytes(_compress(_tar_bytes(top), "tar.gz"))
    write_spec(folder, "base", 'layer: base\nversion: "1"\nsteps:\n'
               "  - copy: {src: ./base, dst: /}\n")
    write_spec(folder, "top", 'layer: top\nversion: "1"\nsteps:\n'
               "  - extract: {src: ./top.tar.gz, dst: /}\n")
    write_spec(folder, "img", 'image: img\nversion: "1"\nlayers: [base@1, top@1]\n')
    store = str(tmp_path / "store")
    run_dsec("build", str(folder), "--store", store)
    # the layer itself holds dsec whiteouts, not the OCI marker files
    files = json.loads(run_dsec("inspect", "top@1", "--files", "--json", "--store",
                                store).stdout)
    names = json.dumps(files)
    assert ".wh." not in names, names
    run_dsec("export", "img@1", str(tmp_path / "out"), "--store", store)
    got = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    assert got == ["a", "a/y", "d", "d/new"], got


class _Server:
    """A TCP server on the host's loopback that records what it is sent."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.settimeout(10)
                    self.got.append(conn.recv(64))
        except OSError:
            pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="run steps use overlay mounts: needs root")
def test_run_steps_have_network_only_when_asked(tmp_path: Path, run_dsec, busybox_tar: Path,  # type: ignore[no-untyped-def]
                                                server: _Server) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    shutil.copy(busybox_tar, folder / "rootfs.tar")
    write_spec(folder, "base", 'layer: base\nversion: "1"\nsteps:\n'
               "  - extract: {src: ./rootfs.tar, dst: /}\n")
    send = f"echo hello | nc -w 5 127.0.0.1 {server.port}; echo rc=$? > /rc"
    write_spec(folder, "off", 'layer: off\nversion: "1"\nfrom: [base@1]\nsteps:\n'
               f"  - run: {json.dumps(send)}\n")
    write_spec(folder, "on", 'layer: on\nversion: "1"\nfrom: [base@1]\nsteps:\n'
               f"  - run: {{cmd: {json.dumps(send)}, network: true}}\n")
    store = str(tmp_path / "store")
    run_dsec("build", str(folder / "base.yaml"), str(folder / "off.yaml"), "--store", store)
    run_dsec("export", "off@1", str(tmp_path / "off"), "--store", store)
    assert (tmp_path / "off" / "rc").read_text() == "rc=1\n"
    assert server.got == []  # nothing reached the host's loopback
    run_dsec("build", str(folder / "on.yaml"), "--store", store)
    run_dsec("export", "on@1", str(tmp_path / "on"), "--store", store)
    assert (tmp_path / "on" / "rc").read_text() == "rc=0\n"
    assert server.got == [b"hello\n"]


def test_store_is_chosen_by_flag_env_project_and_user_config(tmp_path: Path, run_dsec,  # type: ignore[no-untyped-def]
                                                             dsec_home: Path) -> None:
    folder = tmp_path / "specs"
    (folder / "tree").mkdir(parents=True)
    (folder / "tree" / "f").write_text("f")
    spec = write_spec(folder, "s", 'layer: s\nversion: "1"\nsteps:\n'
                      "  - copy: {src: ./tree, dst: /t}\n")
    stores = {k: tmp_path / f"store-{k}" for k in ("user", "project", "env", "flag")}
    user_cfg = dsec_home / "config" / "dsec" / "config.yaml"
    user_cfg.parent.mkdir(parents=True)
    user_cfg.write_text(f"store: {stores['user'].as_uri()}\n")
    project = tmp_path / "project"
    project.mkdir()

    def refs(which: str) -> list[str]:
        st = stores[which]
        return sorted(p.name for p in (st / "refs").iterdir()) if (st / "refs").exists() else []

    run_dsec("build", str(spec), cwd=project)  # no ./dsec.yaml: the user config
    assert (refs("user"), refs("project")) == (["s"], [])
    (project / "dsec.yaml").write_text(f"store: {stores['project'].as_uri()}\n")
    shutil.rmtree(stores["user"])
    run_dsec("build", str(spec), cwd=project)  # ./dsec.yaml over the user config
    assert (refs("user"), refs("project")) == ([], ["s"])
    run_dsec("build", str(spec), cwd=project, env={"DSEC_STORE": stores["env"].as_uri()})
    assert refs("env") == ["s"]  # the environment over both files
    run_dsec("build", str(spec), "--store", str(stores["flag"]), cwd=project,
             env={"DSEC_STORE": stores["env"].as_uri()})
    assert refs("flag") == ["s"]  # the flag over everything
    out = json.loads(run_dsec("ls", "--json", cwd=project).stdout)
    assert [r["ref"] for r in out] == ["s@1"]
    assert not (stores["user"]).exists()


def test_a_relative_data_dir_is_taken_from_where_dsec_runs(tmp_path: Path, run_dsec,  # type: ignore[no-untyped-def]
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """DSEC_DATA_DIR=rel (no store named): the default store is rel/store under the working
    directory, not a traceback about a relative file URI."""
    folder = tmp_path / "specs"
    (folder / "tree").mkdir(parents=True)
    (folder / "tree" / "f").write_text("f")
    spec = write_spec(folder, "s", 'layer: s\nversion: "1"\nsteps:\n'
                      "  - copy: {src: ./tree, dst: /t}\n")
    monkeypatch.delenv("DSEC_STORE", raising=False)
    run_dsec("build", str(spec), cwd=tmp_path, env={"DSEC_DATA_DIR": "rel"})
    assert sorted(p.name for p in (tmp_path / "rel/store/refs").iterdir()) == ["s"]
    out = json.loads(run_dsec("ls", "--json", cwd=tmp_path,
                              env={"DSEC_DATA_DIR": "rel"}).stdout)
    assert [r["ref"] for r in out] == ["s@1"]


def test_pristine_layerspecs_say_what_to_make_first(tmp_path: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    """The committed layerspecs/, without what setup makes: the build stops at the missing
    archive naming the script that makes it (exit 2, no store written); after that script,
    the same tree builds."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files", "layerspecs"], cwd=repo, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, tmp_path / f)
    specs, store = tmp_path / "layerspecs", tmp_path / "store"
    assert not (specs / "busybox/busybox-rootfs.tar").exists()
    p = run_dsec("build", str(specs), "--store", store.as_uri(), check=2)
    err = " ".join(p.stderr.split())
    assert "busybox-rootfs.tar" in err and "make-rootfs.sh" in err, err
    assert not store.exists()
    subprocess.run([str(specs / "busybox/make-rootfs.sh")], check=True)
    out = json.loads(run_dsec("build", str(specs), "--store", store.as_uri(), "--json").stdout)
    assert {"busybox@1.35-1", "demo@1"} <= {i["ref"] for i in out["items"]}, out
