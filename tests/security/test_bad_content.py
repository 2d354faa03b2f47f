"""Hostile content in layers and exports: xattrs, layer counts, export destinations.

An imported image, an archive and a store index are hostile input. A file capability the
kernel refuses at setxattr would break every run and export of a layer, and overlayfs's own
xattrs (`trusted.overlay.*`) would make a layer's directory opaque, a redirect or a
metacopy once a node stacks it: an import refuses the first and drops the second (exit 2,
the member named, the store unchanged), an index in a store holding either is corrupt, and
the lazy filesystem never serves overlayfs's names. An image of more layers than
`limits.layers` is refused where its manifest is read and where it is made, never an
"argument list too long". `dsec export` refuses a destination that is a device or on a
kernel interface and names the destination of any OSError, leaving no partial output.

Every case runs the real command line (`dsec_cli.cli.main`) in this process, as
tests/security/test_bad_input.py does. Nothing is written outside the test's tmp_path: the
/proc and /sys destinations are ones the kernel refuses to create whether or not the wall
holds, and the device is a node made in tmp_path.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import traceback
from dataclasses import replace
from pathlib import Path

import pytest

from dsec_cli.build.layer import layer_manifest
from dsec_cli.format.index import Entry
from dsec_cli.format.manifest import Manifest, load_manifest, put_manifest
from dsec_cli.format.refs import get_ref, set_ref
from dsec_cli.push.dedup import load_index
from dsec_cli.push.stores import Store, open_store
from dsec_cli.run.lazy.fs import LazyFS
from tests.oci.helpers import Image, write_layout

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

CAP = "security.capability"
V2 = (0x02000000).to_bytes(4, "little")
V2_EFFECTIVE = (0x02000001).to_bytes(4, "little")
V3 = (0x03000000).to_bytes(4, "little")
#: a file capability of each well-formed kind: CAP_NET_BIND_SERVICE permitted
GOOD_CAPS = {
    "v2": V2 + (1 << 10).to_bytes(4, "little") + bytes(12),
    "v2-effective": V2_EFFECTIVE + (1 << 10).to_bytes(4, "little") + bytes(12),
    "v3": V3 + (1 << 10).to_bytes(4, "little") + bytes(12) + bytes(4),
}
BAD_CAPS = {
    "3-bytes": b"\x01\x02\x03",
    "empty": b"",
    "v1": (0x01000000).to_bytes(4, "little") + bytes(8),
    "v2-bad-magic": (0x02000002).to_bytes(4, "little") + bytes(16),
    "v2-too-long": V2 + bytes(20),
    "v3-wrong-size": V3 + bytes(24),
    "v3-magic-at-v2-size": V3 + bytes(16),
    "v3-no-uid": V3 + bytes(16) + b"\xff\xff\xff\xff",
}


# -- the command line, in this process -----------------------------------------------------------
def run_main(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
             *argv: str) -> tuple[int, str]:
    """(exit code, stderr as one line) of `dsec ARGV`; a traceback fails the test."""
    from dsec_cli.cli import main

    capfd.readouterr()
    monkeypatch.setattr(sys, "argv", ["dsec", *argv])
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what a user would see as a traceback
        pytest.fail(f"dsec {argv!r:.200} raised:\n{traceback.format_exc()}")
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    return code, " ".join(err.split())  # the renderer wraps long messages


def refused(result: tuple[int, str], *names: str, code: int = 2) -> None:
    got, err = result
    assert got == code, (got, err)
    for n in names:
        assert n in err, (n, err)


def tree_state(root: Path) -> dict[str, str]:
    """Every file under root (a store, a destination's parent) with a hash of its bytes;
    a store's temporary and lease files excepted."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for n in names:
            p = Path(dirpath, n)
            rel = str(p.relative_to(root))
            if rel.startswith(("tmp/", "leases/")):
                continue
            out[rel] = "link" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dsec_home: Path) -> Path:
    """A fresh file store, data and config dir for this test; returns the store's root."""
    store = tmp_path / "store"
    monkeypatch.setenv("DSEC_STORE", store.as_uri())
    monkeypatch.setenv("DSEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DSEC_CONFIG", str(tmp_path / "config.yaml"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("DSEC_MAX_LAYERS", raising=False)
    monkeypatch.chdir(tmp_path)
    return store


def the_store(root: Path) -> Store:
    return open_store(root.as_uri())


def layer_tar(xattrs: dict[str, bytes], name: str = "bin/tool") -> bytes:
    """One directory and one executable whose PAX header carries ``xattrs``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        d = tarfile.TarInfo("bin")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(d)
        f = tarfile.TarInfo(name)
        f.size, f.mode = 5, 0o755
        f.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                         for k, v in xattrs.items()}
        tf.addfile(f, io.BytesIO(b"tool\n"))
    return buf.getvalue()


def layout(path: Path, *layers: bytes) -> Path:
    write_layout(Image(list(layers)), path)
    return path


def seed(env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         capfd: pytest.CaptureFixture[str]) -> dict[str, str]:
    """A store holding one good image, ok@1; its files."""
    refused(run_main(monkeypatch, capfd, "import", str(layout(tmp_path / "ok", layer_tar({}))),
                     "--as", "ok@1"), code=0)
    return tree_state(env)


def entry(st: Store, ref: str, path: str) -> Entry:
    m = load_manifest(st, get_ref(st, ref).manifest)
    if m.kind == "image":
        m = load_manifest(st, m.layers[-1])
    return next(e for e in load_index(st, str(m.index)).entries if e.path == path)


# -- (a) file capabilities ------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(BAD_CAPS))
def test_malformed_capability_in_an_image_is_refused(case: str, env: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """Exit 2 naming the member and the xattr; the store holds what it held."""
    before = seed(env, tmp_path, monkeypatch, capfd)
    bad = layout(tmp_path / "bad", layer_tar({CAP: BAD_CAPS[case]}))
    refused(run_main(monkeypatch, capfd, "import", str(bad), "--as", "bad@1"),
            "'bin/tool'", CAP)
    assert tree_state(env) == before


@pytest.mark.parametrize("case", sorted(BAD_CAPS))
def test_malformed_capability_in_an_extract_step_is_refused(
        case: str, env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    before = seed(env, tmp_path, monkeypatch, capfd)
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "root.tar").write_bytes(layer_tar({CAP: BAD_CAPS[case]}))
    (specs / "x.yaml").write_text(
        'layer: x\nversion: "1"\nsteps:\n  - extract: {src: ./root.tar, dst: /}\n')
    refused(run_main(monkeypatch, capfd, "build", str(specs / "x.yaml")), "'bin/tool'", CAP)
    assert tree_state(env) == before


@pytest.mark.parametrize("case", sorted(GOOD_CAPS))
def test_well_formed_capability_imports_and_exports(case: str, env: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """The two forms the kernel takes are content: kept by the import, written by a tar
    export, and (as root) set by a directory export."""
    value = GOOD_CAPS[case]
    good = layout(tmp_path / "good", layer_tar({CAP: value}))
    refused(run_main(monkeypatch, capfd, "import", str(good), "--as", "good@1"), code=0)
    assert entry(the_store(env), "good@1", "bin/tool").xattrs == {CAP: value}
    refused(run_main(monkeypatch, capfd, "export", "good@1", str(tmp_path / "t.tar")), code=0)
    with tarfile.open(tmp_path / "t.tar") as tf:
        m = tf.getmember("./bin/tool")
        assert m.pax_headers[f"SCHILY.xattr.{CAP}"].encode("utf-8", "surrogateescape") == value
    refused(run_main(monkeypatch, capfd, "export", "good@1", str(tmp_path / "out")), code=0)
    if os.geteuid() == 0:
        assert os.getxattr(tmp_path / "out/bin/tool", CAP)[:4] in (V2, V2_EFFECTIVE, V3)


def crafted_layer(st: Store, name: str, path: str, xattrs: dict[str, bytes]) -> None:
    """``name@1``: the layer of ok@1 with ``xattrs`` on ``path``, its manifest consistent
    with its index (content digest, packs, sizes), as a store writer can publish it."""
    m = load_manifest(st, get_ref(st, "ok@1").manifest)
    lm = load_manifest(st, m.layers[-1])
    index = load_index(st, str(lm.index))
    index = replace(index, entries=[replace(e, xattrs={**e.xattrs, **xattrs})
                                    if e.path == path else e for e in index.entries],
                    entry_json=None)
    digest, _ = layer_manifest(st, index, name=name, version="1")
    set_ref(st, name, "1", digest)


BAD_INDEX_XATTRS = {
    "capability-3-bytes": {CAP: b"\x01\x02\x03"},
    "capability-v3-wrong-size": {CAP: V3 + bytes(24)},
    "overlay-opaque": {"trusted.overlay.opaque": b"y"},
    "overlay-redirect": {"trusted.overlay.redirect": b"/etc"},
    "overlay-metacopy": {"trusted.overlay.metacopy": b""},
}


@pytest.mark.parametrize("case", sorted(BAD_INDEX_XATTRS))
def test_index_in_a_store_with_a_bad_xattr_is_corrupt(case: str, env: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]
                                                      ) -> None:
    """export (directory and tar) and inspect refuse it naming the index, the path and the
    xattr; nothing is written."""
    seed(env, tmp_path, monkeypatch, capfd)
    st = the_store(env)
    crafted_layer(st, "crafted", "bin/tool", BAD_INDEX_XATTRS[case])
    lm = load_manifest(st, get_ref(st, "crafted@1").manifest)
    name = next(iter(BAD_INDEX_XATTRS[case]))
    before = tree_state(env)
    for dest in ("out", "out.tar"):
        refused(run_main(monkeypatch, capfd, "export", "crafted@1", str(tmp_path / dest)),
                f"index {str(lm.index)[:12]}", "'bin/tool'", name)
        assert not (tmp_path / dest).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert tree_state(env) == before


def test_overlay_xattrs_of_an_image_are_not_stored(env: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capfd: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """docs/format.md: `trusted.overlay.*` is never stored. The import drops them (with a
    warning naming each) and keeps the rest; the layer exports."""
    img = layout(tmp_path / "ovl", layer_tar({"trusted.overlay.redirect": b"/etc",
                                              "trusted.overlay.opaque": b"y",
                                              "user.note": b"kept"}))
    code, err = run_main(monkeypatch, capfd, "import", str(img), "--as", "ovl@1")
    assert code == 0, err
    assert "'bin/tool': xattr 'trusted.overlay.redirect' dropped" in caplog.text
    assert entry(the_store(env), "ovl@1", "bin/tool").xattrs == {"user.note": b"kept"}
    refused(run_main(monkeypatch, capfd, "export", "ovl@1", str(tmp_path / "o.tar")), code=0)
    with tarfile.open(tmp_path / "o.tar") as tf:
        assert not [k for m in tf.getmembers() for k in m.pax_headers if "overlay" in k]


def test_lazy_fs_never_serves_overlay_xattrs() -> None:
    """Whatever an index holds, the lazy filesystem (the lower dir overlayfs reads on the
    lazy path) answers overlayfs's names only with an opaque directory's marker."""
    from dsec_cli.format.index import LayerIndex

    ix = LayerIndex(entries=[
        Entry(".", "dir", 0o755),
        Entry("d", "dir", 0o755, opaque=True,
              xattrs={"trusted.overlay.redirect": b"/etc", "user.a": b"1"}),
        Entry("f", "reg", 0o644, xattrs={"trusted.overlay.metacopy": b"",
                                         "trusted.overlay.opaque": b"y"})],
                    chunks=[], packs=[])
    fs = LazyFS([ix], [])
    assert sorted(fs.listxattr("/0/d")) == ["trusted.overlay.opaque", "user.a"]
    assert fs.getxattr("/0/d", "trusted.overlay.opaque") == b"y"
    assert fs.getxattr("/0/d", "user.a") == b"1"
    assert fs.listxattr("/0/f") == []
    for path, name in (("/0/d", "trusted.overlay.redirect"), ("/0/f", "trusted.overlay.metacopy"),
                       ("/0/f", "trusted.overlay.opaque")):
        with pytest.raises(OSError):
            fs.getxattr(path, name)


# -- (c) layer counts -----------------------------------------------------------------------------
def test_image_of_20000_layers_is_refused(env: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    """A store writer's image manifest naming one layer 20,000 times: inspect, export and
    run refuse it naming the manifest and the count, before any mount or argv is made."""
    seed(env, tmp_path, monkeypatch, capfd)
    st = the_store(env)
    layer = load_manifest(st, get_ref(st, "ok@1").manifest).layers[0]
    digest = put_manifest(st, Manifest(kind="image", name="many", version="1",
                                       layers=[layer] * 20_000))
    set_ref(st, "many", "1", digest)
    before = tree_state(env)
    for argv in (["inspect", "many@1"], ["export", "many@1", str(tmp_path / "out")],
                 ["run", "many@1", "--", "true"]):
        refused(run_main(monkeypatch, capfd, *argv), f"manifest {digest[:12]}",
                "20000 layers", "limits.layers")
    assert tree_state(env) == before
    assert not (tmp_path / "out").exists()


def test_import_of_too_many_layers_is_refused(env: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    """Refused from the image's manifest, before any layer is read: the store unchanged."""
    before = seed(env, tmp_path, monkeypatch, capfd)
    monkeypatch.setenv("DSEC_MAX_LAYERS", "2")
    img = layout(tmp_path / "three", *(layer_tar({}, f"bin/t{n}") for n in range(3)))
    refused(run_main(monkeypatch, capfd, "import", str(img), "--as", "three@1"),
            "three@1", "3 layers", "limits.layers")
    assert tree_state(env) == before


def test_image_spec_of_too_many_layers_is_refused(env: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    seed(env, tmp_path, monkeypatch, capfd)
    specs = tmp_path / "specs"
    specs.mkdir()
    for n in range(3):
        (specs / f"l{n}.yaml").write_text(f'layer: l{n}\nversion: "1"\nsteps:\n'
                                          f'  - copy: {{src: ./l{n}.yaml, dst: /l{n}}}\n')
    (specs / "img.yaml").write_text('image: img\nversion: "1"\nlayers: [l0@1, l1@1, l2@1]\n')
    monkeypatch.setenv("DSEC_MAX_LAYERS", "2")
    refused(run_main(monkeypatch, capfd, "build", str(specs)), "img@1", "3 layers",
            "limits.layers")
    st = the_store(env)
    with pytest.raises(Exception, match="img@1"):
        get_ref(st, "img@1")


# -- (d) export destinations ----------------------------------------------------------------------
KERNEL_DESTS = ["/proc/dsec-export-test", "/proc/dsec-export-test.tar",
                "/proc/self/dsec-export-test", "/sys/dsec-export-test",
                "/sys/dsec-export-test.tar", "/proc/dsec-export-test/oci"]


@pytest.mark.parametrize("dest", KERNEL_DESTS)
def test_export_to_a_kernel_interface_is_refused(dest: str, env: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    seed(env, tmp_path, monkeypatch, capfd)
    argv = ["export", "ok@1", dest]
    if dest.endswith("/oci"):
        argv += ["--format", "oci"]
    refused(run_main(monkeypatch, capfd, *argv), dest, "kernel interface")
    assert not os.path.lexists(dest)


@root_only
@pytest.mark.parametrize("suffix", [".tar", ""])
def test_export_onto_a_device_is_refused(suffix: str, env: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    """A device node (made in tmp_path, a copy of /dev/null's numbers) stays a device."""
    seed(env, tmp_path, monkeypatch, capfd)
    dev = tmp_path / f"dev{suffix}"
    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))
    refused(run_main(monkeypatch, capfd, "export", "ok@1", str(dev)), str(dev), "a device")
    assert os.stat(dev).st_rdev == os.makedev(1, 3)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("dest", ["file/out", "file/out.tar", "file/oci"])
def test_export_below_a_file_names_the_destination(dest: str, env: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """An OSError on the destination (here ENOTDIR) is exit 2 naming it."""
    seed(env, tmp_path, monkeypatch, capfd)
    (tmp_path / "file").write_text("a file\n")
    argv = ["export", "ok@1", str(tmp_path / dest)]
    if dest.endswith("oci"):
        argv += ["--format", "oci"]
    refused(run_main(monkeypatch, capfd, *argv), str(tmp_path / dest), "Not a directory")
    assert (tmp_path / "file").read_text() == "a file\n"


@root_only
@pytest.mark.parametrize("dest", ["out", "out.tar"])
def test_export_that_runs_out_of_space_is_a_runtime_error(dest: str, env: Path,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]
                                                          ) -> None:
    """ENOSPC half-way is exit 1 naming the destination, and leaves nothing behind."""
    big = tmp_path / "big"
    big.mkdir()
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("big.bin")
        ti.size = 1 << 20
        tf.addfile(ti, io.BytesIO(os.urandom(1 << 20)))
    refused(run_main(monkeypatch, capfd, "import", str(layout(big / "img", tar.getvalue())),
                     "--as", "big@1"), code=0)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                   check=True, timeout=60)
    try:
        refused(run_main(monkeypatch, capfd, "export", "big@1", str(small / dest)),
                str(small / dest), "No space left", code=1)
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True, timeout=60)
