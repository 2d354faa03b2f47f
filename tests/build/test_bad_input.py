"""Every bad spec is refused with exit code 2, a message naming file and line, and no
change to the store."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from .conftest import store_snapshot, write_spec

GOOD = 'layer: good\nversion: "1"\nsteps:\n  - copy: {src: ./f, dst: /f}\n'


def _tar(path: Path, members: list[tuple[str, str, str]]) -> None:
    """members: (name, type, linkname)."""
    with tarfile.open(path, "w") as tf:
        for name, kind, link in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                ti.size = 2
                tf.addfile(ti, io.BytesIO(b"hi"))
                continue
            ti.type = {"sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}[kind]
            ti.linkname = link
            tf.addfile(ti)


CASES = {
    "unknown top-level key": ('layer: x\nversion: "1"\nstepz: []\n', 3, "unknown key 'stepz'"),
    "unknown step key": ('layer: x\nversion: "1"\nsteps:\n  - copy: {src: ./f, dst: /f, '
                         'chmod: 1}\n', 4, "unknown key 'chmod'"),
    "unknown step": ('layer: x\nversion: "1"\nsteps:\n  - download: {url: x}\n', 4,
                     "unknown step 'download'"),
    "wrong type": ('layer: x\nversion: "1"\nfrom: busybox@1\nsteps:\n  - run: "true"\n', 3,
                   "from must be a list"),
    "missing version": ("layer: x\nsteps:\n  - run: 'true'\n", 1, "missing `version:`"),
    "missing source": ('layer: x\nversion: "1"\nsteps:\n  - copy: {src: ./nope, dst: /n}\n',
                       4, "does not exist"),
    "src escapes": ('layer: x\nversion: "1"\nsteps:\n  - copy: {src: ../outside, dst: /n}\n',
                    4, "escapes the spec's folder"),
    "dst escapes": ('layer: x\nversion: "1"\nsteps:\n  - copy: {src: ./f, dst: /a/../../b}\n',
                    4, "escapes /"),
    "relative dst": ('layer: x\nversion: "1"\nsteps:\n  - copy: {src: ./f, dst: a}\n', 4,
                     "must be an absolute path"),
    "unknown layer": ('layer: x\nversion: "1"\nfrom:\n  - ghost@9\nsteps:\n  - run: "true"\n',
                      4, "unknown layer ghost@9"),
    "bad ref": ('layer: "x y"\nversion: "1"\nsteps:\n  - run: "true"\n', 1,
                "invalid reference"),
    "bad yaml": ('layer: x\nversion: "1\nsteps: [\n', None, "not valid YAML"),
    "not an archive type": ('layer: x\nversion: "1"\nsteps:\n  - extract: {src: ./f, dst: /}\n',
                            4, "must be a .tar"),
    "bad owner": ('layer: x\nversion: "1"\nsteps:\n  - copy: {src: ./f, dst: /f, owner: root}\n',
                  4, "UID or UID:GID"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_spec(case: str, tmp_path: Path, run_dsec) -> None:
    text, line, message = CASES[case]
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "f").write_text("f")
    (tmp_path / "outside").write_text("secret")
    write_spec(folder, "good", GOOD)
    bad = write_spec(folder, "bad", text)
    store = tmp_path / "store"
    run_dsec("build", str(folder / "good.yaml"), "--store", str(store))
    before = store_snapshot(store)
    p = run_dsec("build", str(folder), "--store", str(store), check=2)
    where = f"{bad}:{line}:" if line else f"{bad}"
    assert where in p.stderr and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert store_snapshot(store) == before


def test_cycle_names_the_files(tmp_path: Path, run_dsec) -> None:
    folder = tmp_path / "specs"
    write_spec(folder, "a", 'layer: a\nversion: "1"\nfrom: [b@1]\nsteps:\n  - run: "true"\n')
    write_spec(folder, "b", 'layer: b\nversion: "1"\nfrom: [a@1]\nsteps:\n  - run: "true"\n')
    p = run_dsec("build", str(folder), "--store", str(tmp_path / "store"), check=2)
    assert "dependency cycle" in p.stderr and "a.yaml" in p.stderr and "b.yaml" in p.stderr
    assert not (tmp_path / "store/refs").exists()


@pytest.mark.parametrize("members,message", [
    ([("../evil", "file", "")], "escapes the root"),
    ([("/etc/evil", "file", "")], "absolute path"),
    ([("ok", "file", ""), ("a/b/up", "sym", "../../../etc")], "points outside the root"),
    ([("ok", "file", ""), ("h", "hard", "../../etc/passwd")], "escapes the root"),
    ([("h", "hard", "missing")], "no regular file target"),
])
def test_bad_archive(members, message, tmp_path: Path, run_dsec) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    _tar(folder / "evil.tar", members)
    spec = write_spec(folder, "x", 'layer: x\nversion: "1"\nsteps:\n'
                      "  - extract: {src: ./evil.tar, dst: /}\n")
    store = tmp_path / "store"
    p = run_dsec("build", str(spec), "--store", str(store), check=2)
    assert message in p.stderr and "evil.tar" in p.stderr, p.stderr
    assert not (store / "refs").exists() and not list((store / "tmp").glob("*"))


def test_absolute_symlinks_stay_inside_the_layer(tmp_path: Path, run_dsec) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    _tar(folder / "ok.tar", [("etc/file", "file", ""), ("etc/abs", "sym", "/etc/file")])
    spec = write_spec(folder, "x", 'layer: x\nversion: "1"\nsteps:\n'
                      "  - extract: {src: ./ok.tar, dst: /}\n")
    run_dsec("build", str(spec), "--store", str(tmp_path / "store"))


def test_failing_run_step_is_a_runtime_error(tmp_path: Path, run_dsec, busybox_tar) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    shutil.copy(busybox_tar, folder / "rootfs.tar")
    write_spec(folder, "base", 'layer: base\nversion: "1"\nsteps:\n'
               "  - extract: {src: ./rootfs.tar, dst: /}\n")
    write_spec(folder, "fails", 'layer: fails\nversion: "1"\nfrom: [base@1]\nsteps:\n'
               "  - run: echo about to fail; exit 3\n")
    store = tmp_path / "store"
    p = run_dsec("build", str(folder), "--store", str(store), check=1)
    assert "fails.yaml:5: run step exited with code 3" in p.stderr
    assert "about to fail" in p.stderr
    assert (store / "refs/base/1").exists() and not (store / "refs/fails").exists()


def test_unknown_ref_and_bad_store(tmp_path: Path, run_dsec) -> None:
    (tmp_path / "s").mkdir()
    p = run_dsec("inspect", "nothing@1", "--store", str(tmp_path / "s"), check=2)
    assert "no layer or image nothing@1" in p.stderr
    p = run_dsec("inspect", "nothing@1", "--store", str(tmp_path / "typo"), check=2)
    assert f"no store at {tmp_path / 'typo'}" in " ".join(p.stderr.split())
    p = run_dsec("ls", "--store", "ftp://host/x", check=2)
    assert "unknown store URL scheme" in p.stderr
    p = run_dsec("build", str(tmp_path / "missing-dir"), check=2)
    assert "no such spec file or directory" in p.stderr


def test_run_layer_over_another_base_is_allowed_with_a_warning(tmp_path: Path, run_dsec,
                                                               busybox_tar) -> None:


    folder = tmp_path / "specs"
    folder.mkdir()
    shutil.copy(busybox_tar, folder / "rootfs.tar")
    write_spec(folder, "base", 'layer: base\nversion: "1"\nsteps:\n'
               "  - extract: {src: ./rootfs.tar, dst: /}\n")
    write_spec(folder, "other", 'layer: other\nversion: "1"\nsteps:\n'
               "  - extract: {src: ./rootfs.tar, dst: /}\n  - copy: {src: ./base.yaml, dst: /x}\n")
    write_spec(folder, "app", 'layer: app\nversion: "1"\nfrom: [base@1]\nsteps:\n'
               "  - run: echo hi > /hi\n")
    write_spec(folder, "img", 'image: img\nversion: "1"\nlayers: [other@1, app@1]\n')
    out = json.loads(run_dsec("build", str(folder), "--store", str(tmp_path / "store"),
                              "--json").stdout)
    assert len(out["warnings"]) == 1 and "app@1 was built on" in out["warnings"][0]
    p = run_dsec("build", str(folder / "img.yaml"), "--store", str(tmp_path / "store"),
                 "--force")
    assert "warning:" in p.stderr and "does not stack below it" in p.stderr
