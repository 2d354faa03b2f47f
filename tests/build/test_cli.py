"""The build-stage commands end to end on the example layerspecs, as a user runs them."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from ..treecmp import describe


def test_example_layerspecs_build_list_inspect_export(tmp_path: Path, run_dsec,
                                                      busybox_tar) -> None:
    store = str(tmp_path / "store")
    built = json.loads(run_dsec("build", "--store", store, "--json").stdout)
    refs = {i["ref"]: i for i in built["items"]}
    assert set(refs) == {"busybox@1.35-1", "tools@1", "webapp@1", "demo@1"}
    assert not any(i["cached"] for i in built["items"])
    again = json.loads(run_dsec("build", "--store", store, "--json").stdout)
    assert all(i["cached"] for i in again["items"])

    listed = json.loads(run_dsec("ls", "--store", store, "--json").stdout)
    assert {i["ref"] for i in listed} == set(refs)
    images = json.loads(run_dsec("ls", "images", "--store", store, "--json").stdout)
    assert [i["ref"] for i in images] == ["demo@1"]

    doc = json.loads(run_dsec("inspect", "demo@1", "--store", store, "--json").stdout)
    assert [layer["ref"] for layer in doc["layers"]] == ["busybox@1.35-1", "tools@1", "webapp@1"]
    assert doc["workdir"] == "/srv/www" and doc["env"]["APP_HOME"] == "/srv/www"
    layer = json.loads(run_dsec("inspect", "webapp@1", "--store", store, "--json",
                                "--files").stdout)
    types = {f["path"]: f["type"] for f in layer["files"]}
    assert types["etc/motd"] == "whiteout" and types["srv/www/build.txt"] == "reg"
    assert layer["manifest"]["base"] == [refs["busybox@1.35-1"]["manifest"]]

    out = tmp_path / "rootfs"
    run_dsec("export", "demo@1", str(out), "--store", store)
    assert (out / "bin/busybox").is_file() and (out / "opt/tools/bin/hello").is_file()
    assert not (out / "etc/motd").exists()  # deleted by the webapp layer's run step
    assert "app:x:1000" in (out / "etc/passwd").read_text()
    assert describe(out)["srv/www/build.txt"]["mtime"] == 0  # run outputs: fixed timestamp

    run_dsec("export", "demo@1", str(tmp_path / "demo.tar"), "--store", store)
    with tarfile.open(tmp_path / "demo.tar") as tf:
        names = set(tf.getnames())
    assert "./opt/tools/bin/hello" in names and "./etc/motd" not in names

    p = run_dsec("export", "demo@1", str(out), "--store", store, check=2)
    assert "not an empty directory" in p.stderr


def test_default_store_and_env_override(tmp_path: Path, run_dsec, busybox_tar,
                                        dsec_home: Path) -> None:
    run_dsec("build", "layerspecs/tools")
    default = dsec_home / "data/dsec/store/refs/tools/1"
    assert default.is_file()
    other = tmp_path / "elsewhere"
    run_dsec("build", "layerspecs/tools", env={"DSEC_STORE": other.as_uri()})
    assert (other / "refs/tools/1").is_file()
    listed = json.loads(run_dsec("ls", "--json", env={"DSEC_STORE": str(other)}).stdout)
    assert [i["ref"] for i in listed] == ["tools@1"]
