"""A tree written into a layer and exported again is the same tree, byte for byte and in
metadata: regular files of every size, directories, symlinks, hardlinks, modes (setuid,
sticky), uid/gid, nanosecond mtimes, xattrs, device nodes and fifos."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

from dsec_cli.build.builder import build
from dsec_cli.build.layer import build_layer_from_dir
from dsec_cli.push.materialize import export

from ..treecmp import assert_same_tree, describe
from .conftest import write_spec


def test_directory_round_trip_keeps_everything(tree: Path, store, tmp_path: Path) -> None:
    build_layer_from_dir(store, tree, "tree", "1", created_by="test")
    out = tmp_path / "out"
    export(store, "tree@1", out)
    assert_same_tree(tree, out)
    d = describe(out)
    assert d["bin/tool"]["mode"] == "-rwsr-xr-x" and d["bin/tool"]["uid"] == 1234
    assert d["data/null"]["rdev"] == (1, 3)
    assert d["etc/small.conf"]["xattrs"] == {"user.dsec.test": b"\x00binary\xff"}
    assert d["data/hard-a"]["link_group"] == d["etc/hard-b"]["link_group"]


def test_tar_export_matches_directory_export(tree: Path, store, tmp_path: Path) -> None:
    build_layer_from_dir(store, tree, "tree", "1")
    export(store, "tree@1", tmp_path / "layer.tar")
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner",
                    "--same-permissions", "-xpf", str(tmp_path / "layer.tar"), "-C",
                    str(unpacked)], check=True)
    # GNU tar restores what pax carries: compare everything but nanoseconds of mtimes
    strip = {p: {k: v for k, v in d.items() if k != "mtime"} for p, d in describe(tree).items()}
    got = {p: {k: v for k, v in d.items() if k != "mtime"} for p, d in describe(unpacked).items()}
    assert got == strip
    with tarfile.open(tmp_path / "layer.tar") as tf:
        member = tf.getmember("./data/deep/er/large.bin")
        assert member.size == 1_000_000 and int(member.mtime) == int(
            (tree / "data/deep/er/large.bin").lstat().st_mtime)


def test_extract_step_round_trip(tree: Path, store, tmp_path: Path) -> None:
    specdir = tmp_path / "spec"
    specdir.mkdir()
    subprocess.run(["tar", "--xattrs", "--xattrs-include=user.*", "--format=pax", "-C",
                    str(tree), "-cf", str(specdir / "root.tar"), "."], check=True)
    subprocess.run(["zstd", "-q", "-3", str(specdir / "root.tar"), "-o",
                    str(specdir / "root.tar.zst")], check=True)
    write_spec(specdir, "x", 'layer: x\nversion: "1"\nsteps:\n'
               '  - extract: {src: ./root.tar.zst, dst: /, keep_mtime: true}\n')
    build([specdir / "x.yaml"], store)
    out = tmp_path / "out"
    export(store, "x@1", out)
    assert_same_tree(tree, out)


def test_copy_step_places_files_and_normalizes_owner(tree: Path, store, tmp_path: Path) -> None:
    specdir = tmp_path / "spec"
    (specdir / "files").mkdir(parents=True)
    (specdir / "files/a.txt").write_text("a")
    (specdir / "one.conf").write_text("x=1\n")
    write_spec(specdir, "c", 'layer: c\nversion: "1"\nsteps:\n'
               "  - copy: {src: ./files, dst: /opt/app}\n"
               "  - copy: {src: ./one.conf, dst: /etc/app/app.conf, owner: '1000:1000', "
               "mode: '0640'}\n")
    build([specdir / "c.yaml"], store)
    out = tmp_path / "out"
    export(store, "c@1", out)
    d = describe(out)
    assert (out / "opt/app/a.txt").read_text() == "a"
    assert d["etc/app/app.conf"]["uid"] == 1000 and d["etc/app/app.conf"]["mode"] == "-rw-r-----"
    assert d["opt/app/a.txt"]["uid"] == 0
    assert d["etc/app"]["mode"] == "drwxr-xr-x"
