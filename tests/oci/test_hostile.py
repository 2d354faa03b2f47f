"""Hostile images: layers whose bytes do not match their digests, and layers whose
entries would write outside the layer, are refused (exit 2, the digest or entry named,
the store unchanged); device nodes are dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsec_cli.api import images, oci

from .conftest import store_files
from .helpers import (
    Image,
    Member,
    base_image,
    device,
    directory,
    file,
    hardlink,
    symlink,
    write_layout,
)


def _text(stderr: str) -> str:
    """The error as one line (the terminal renderer wraps long messages)."""
    return " ".join(stderr.split())


@pytest.fixture
def seeded(env: dict[str, str], tmp_path: Path) -> dict[str, int]:
    """A store holding one imported image, and its objects before the hostile import."""
    write_layout(Image([[file("ok", b"ok")]]), tmp_path / "seed")
    oci.import_image(str(tmp_path / "seed"), as_ref="seed@1")
    return store_files(env)


@pytest.mark.parametrize("which", [0, 1])
def test_tampered_layer_is_refused_naming_its_digest(env: dict[str, str], tmp_path: Path,
                                                     seeded: dict[str, int], which: int,
                                                     run_dsec) -> None:  # type: ignore[no-untyped-def]
    """Either layer of two read side by side: the tampered one is named, the other one's
    work is dropped, the store unchanged."""
    digests = write_layout(base_image(), tmp_path / "bad", tamper=which)
    bad = json.loads(digests["layers"])[which]
    p = run_dsec("import", str(tmp_path / "bad"), "--as", "bad@1", check=2)
    assert bad in _text(p.stderr) and "refused" in p.stderr
    assert store_files(env) == seeded


def test_wrong_diff_id_is_refused(env: dict[str, str], tmp_path: Path,
                                  seeded: dict[str, int], run_dsec) -> None:  # type: ignore[no-untyped-def]
    lay = tmp_path / "bad"
    write_layout(Image([[file("a", b"a")]]), lay)
    index = json.loads((lay / "index.json").read_text())
    mpath = lay / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    manifest = json.loads(mpath.read_text())
    cpath = lay / "blobs/sha256" / manifest["config"]["digest"][7:]
    config = json.loads(cpath.read_text())
    wrong = "sha256:" + "0" * 64
    config["rootfs"]["diff_ids"] = [wrong]
    # a consistent layout around the lie: config, manifest and index re-hashed
    import hashlib

    def put(doc: dict) -> dict:  # type: ignore[type-arg]
        data = json.dumps(doc).encode()
        d = hashlib.sha256(data).hexdigest()
        (lay / "blobs/sha256" / d).write_bytes(data)
        return {"digest": f"sha256:{d}", "size": len(data)}

    manifest["config"].update(put(config))
    index["manifests"][0].update(put(manifest))
    (lay / "index.json").write_text(json.dumps(index))
    p = run_dsec("import", str(lay), "--as", "bad@1", check=2)
    assert wrong in _text(p.stderr)
    assert store_files(env) == seeded


@pytest.mark.parametrize("members,needle", [
    ([file("../escape", b"x")], "escapes the root"),
    ([file("/etc/abs", b"x")], "absolute path"),
    ([symlink("out", "../../../../etc")], "outside the root"),
    ([symlink("etc", "/etc"), file("etc/passwd", b"root::0:0::/:/bin/sh")], "lies below"),
    ([hardlink("h", "../../etc/shadow")], "escapes the root"),
    ([hardlink("h", "etc/shadow")], "no regular file target"),
    ([directory("d"), file("d/.wh.x", b""), symlink("d2", "/"),
      file("d2/.wh..wh..opq", b"")], "lies below"),
], ids=["dotdot", "absolute", "symlink-out", "write-through-symlink", "hardlink-dotdot",
        "hardlink-outside", "opaque-through-symlink"])
def test_hostile_entries_are_refused(env: dict[str, str], tmp_path: Path,
                                     seeded: dict[str, int], members: list[Member],
                                     needle: str, run_dsec) -> None:  # type: ignore[no-untyped-def]
    write_layout(Image([members]), tmp_path / "evil")
    p = run_dsec("import", str(tmp_path / "evil"), "--as", "evil@1", check=2)
    assert needle in _text(p.stderr)
    assert store_files(env) == seeded


def test_devices_are_dropped_and_overlay_whiteouts_kept(env: dict[str, str],
                                                        tmp_path: Path) -> None:
    lower = [file("gone", b"x"), file("keep", b"k")]
    upper = [device("mem", 1, 1), device("null", 1, 3), device("gone", 0, 0)]
    write_layout(Image([lower, upper]), tmp_path / "dev")
    oci.import_image(str(tmp_path / "dev"), as_ref="dev@1")
    layer = images.inspect("dev@1")["layers"][1]["ref"]
    files = {f["path"]: f["type"] for f in images.inspect(layer, files=True)["files"]}
    assert files == {".": "dir", "gone": "whiteout"}
    images.export_image("dev@1", tmp_path / "tree")
    assert sorted(p.name for p in (tmp_path / "tree").iterdir()) == ["keep"]


def test_garbage_blob_is_refused(env: dict[str, str], tmp_path: Path,
                                 seeded: dict[str, int], run_dsec) -> None:  # type: ignore[no-untyped-def]
    """A blob that is not a tar stream (its digest right) is refused by name, not a crash."""
    lay = tmp_path / "junk"
    write_layout(Image([[file("a", b"a")]], ["gzip"]), lay)
    index = json.loads((lay / "index.json").read_text())
    manifest = json.loads((lay / "blobs/sha256" / index["manifests"][0]["digest"][7:])
                          .read_text())
    layer = manifest["layers"][0]["digest"]
    blob = lay / "blobs/sha256" / layer[7:]
    blob.write_bytes(b"\x1f\x8b" + b"\x00" * (blob.stat().st_size - 2))
    p = run_dsec("import", str(lay), "--as", "junk@1", check=2)
    assert "error:" in p.stderr and "Traceback" not in p.stderr
    assert store_files(env) == seeded


def _broken(how: str) -> bytes:
    from .helpers import compress, layer_tar

    plain = layer_tar([file("a", b"a" * 100_000), file("b", bytes(range(256)) * 400)])
    gz = compress(plain, "gzip")
    if how == "gzip-truncated":
        return gz[:len(gz) // 2]
    if how == "gzip-corrupt":
        return gz[:len(gz) // 2] + bytes([gz[len(gz) // 2] ^ 0xFF]) + gz[len(gz) // 2 + 1:]
    if how == "gzip-trailing-garbage":
        return gz + b"garbage"
    return plain[:60_000]  # tar-truncated: the stream ends inside a member's data


@pytest.mark.parametrize("how", ["gzip-truncated", "gzip-corrupt", "gzip-trailing-garbage",
                                 "tar-truncated"])
def test_broken_stream_with_a_right_digest_is_refused(env: dict[str, str], tmp_path: Path,
                                                      seeded: dict[str, int], how: str,
                                                      run_dsec) -> None:  # type: ignore[no-untyped-def]
    """A blob whose digest and diff_id match its bytes, but whose gzip or tar stream is
    cut short or damaged, is refused as unreadable (exit 2), the store unchanged."""
    # stored as an uncompressed layer: the blob is the bytes given, its diff_id their digest;
    # the reader sniffs gzip by its magic whatever the media type says
    write_layout(Image([_broken(how)], ["none"]), tmp_path / "broken")
    p = run_dsec("import", str(tmp_path / "broken"), "--as", "broken@1", check=2)
    text = _text(p.stderr)
    assert "cannot read it as a tar stream" in text or "cannot decompress it" in text, text
    assert "Traceback" not in p.stderr
    assert store_files(env) == seeded


def test_oversized_config_is_refused_before_any_layer(env: dict[str, str], tmp_path: Path,
                                                      seeded: dict[str, int],
                                                      run_dsec) -> None:  # type: ignore[no-untyped-def]
    """Env and labels that would make an unreadable dsec manifest are refused up front."""
    img = Image([[file("a", b"a")]], env=[f"BIG={'x' * (70 << 10)}"])
    write_layout(img, tmp_path / "huge")
    p = run_dsec("import", str(tmp_path / "huge"), "--as", "huge@1", check=2)
    assert "too large" in _text(p.stderr)
    assert store_files(env) == seeded
