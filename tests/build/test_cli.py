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


def _dsec_loading(argv: list[str], via_typer: bool = False) -> tuple[int, str, str, list[str]]:
    """`dsec ARGV` in a fresh interpreter (through typer when asked): exit code, output and
    which of typer, click and pydantic it had loaded at exit."""
    import os
    import subprocess
    import sys

    entry = ("from dsec_cli.cli.group import app\napp()\n" if via_typer else
             "from dsec_cli.cli import main\nmain()\n")
    code = ("import atexit, json, os, sys\n"
            "atexit.register(lambda: os.write(2, ('\\nLOADED ' + json.dumps(sorted(m for m in "
            "('typer', 'click', 'pydantic') if m in sys.modules)) + '\\n').encode()))\n"
            "sys.argv = ['dsec', *sys.argv[1:]]\n" + entry)
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       env=dict(os.environ), timeout=300)
    err, _, loaded = p.stderr.rpartition("\nLOADED ")
    return p.returncode, p.stdout, err, json.loads(loaded)


def test_a_plain_build_skips_typer_and_matches_it(tmp_path: Path) -> None:
    """`dsec build` in its plain forms runs through the fast launcher (cli/fast.py) without
    typer or pydantic (a no-op build without click either), and reports what the typer
    command reports; other forms (unknown options, --help) still go to typer."""
    (tmp_path / "s/tree").mkdir(parents=True)
    (tmp_path / "s/tree/a.txt").write_text("a\n")
    (tmp_path / "s/l.yaml").write_text('layer: l\nversion: "1"\nsteps:\n'
                                       "  - copy: {src: ./tree, dst: /app}\n")
    store = str(tmp_path / "store")
    rc, out, err, loaded = _dsec_loading(["build", str(tmp_path / "s"), "--store", store,
                                          "--json"])
    # (a build that chunks loads click: the chunker's package imports it)
    assert rc == 0 and not {"typer", "pydantic"} & set(loaded), (err, loaded)
    first = json.loads(out)["items"][0]
    assert not first["cached"]
    fast = _dsec_loading(["build", str(tmp_path / "s"), f"--store={store}", "--json"])
    slow = _dsec_loading(["build", str(tmp_path / "s"), "--store", store, "--json"],
                         via_typer=True)
    assert fast[0] == slow[0] == 0 and fast[3] == []
    assert json.loads(fast[1]) == json.loads(slow[1])
    assert json.loads(fast[1])["items"][0]["cached"]
    rc, out, _, loaded = _dsec_loading(["build", str(tmp_path / "s"), "--store", store])
    assert rc == 0 and loaded == [] and "cached" in out
    # a spec error exits 2 with the message, from the one error printer
    (tmp_path / "s/l.yaml").write_text("layer: l\n")
    rc, _, err, _ = _dsec_loading(["build", str(tmp_path / "s"), "--store", store])
    assert rc == 2 and "version" in err, err
    for argv, rc_want, says in ((["build", "--bogus"], 2, "No such option"),
                                (["build", "--store"], 2, "requires an argument"),
                                (["build", "--help"], 0, "Usage")):
        rc, out, err, loaded = _dsec_loading(argv)
        assert "typer" in loaded, argv
        assert rc == rc_want and says in out + err, (argv, out, err)
