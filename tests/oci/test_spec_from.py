"""Specs build on OCI images: `from: [oci:HOST/REPO:TAG]` imports the image on demand, its
layers are the base of `run` steps, and the build report pins the manifest digest."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from dsec_cli.api import images

from .helpers import Image, skopeo, write_layout


def test_spec_from_an_oci_image(env: dict[str, str], tmp_path: Path, registry: str,
                                busybox_tar: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    write_layout(Image([busybox_tar.read_bytes()], env=["PATH=/bin"], workdir="/"),
                 tmp_path / "bb")
    skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'bb'}:v1",
           f"docker://{registry}/lib/bb:v1")
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                          f"docker://{registry}/lib/bb:v1"], check=True, capture_output=True,
                         timeout=120).stdout
    pushed = "sha256:" + hashlib.sha256(raw).hexdigest()
    specs = tmp_path / "specs"
    specs.mkdir()
    base = f"oci:{registry}/lib/bb:v1"
    (specs / "task.yaml").write_text(
        f'layer: task\nversion: "1"\nfrom: ["{base}"]\n'
        'steps:\n  - run: "busybox echo built > /made.txt"\n')
    (specs / "img.yaml").write_text(
        f'image: taskimg\nversion: "1"\nlayers: ["{base}", task@1]\n')
    report = json.loads(run_dsec("build", str(specs), "--json").stdout)
    assert report["pinned"] == {base: pushed}
    images.export_image("taskimg@1", tmp_path / "tree")
    assert (tmp_path / "tree/made.txt").read_text() == "built\n"
    assert (tmp_path / "tree/bin/busybox").is_file()
    # a second build reads nothing again: the layers are in the store, the build cached
    again = json.loads(run_dsec("build", str(specs), "--json").stdout)
    assert all(i["cached"] for i in again["items"]) and again["pinned"] == {base: pushed}


def test_specs_on_several_images_import_them_in_one_run(
        env: dict[str, str], tmp_path: Path, registry: str, busybox_tar: Path,
        run_dsec) -> None:  # type: ignore[no-untyped-def]
    """Two specs on two images that share their base: both images come in with one build
    (each spec on its own image's layers, both pinned); a third spec naming an image the
    registry lacks is refused with its file, line and the image named, exit 2."""
    from .helpers import file

    for name in ("a", "b"):
        write_layout(Image([busybox_tar.read_bytes(), [file(f"srv/{name}.txt", name.encode())]],
                           env=["PATH=/bin"], workdir="/"), tmp_path / name)
        skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / name}:v1",
               f"docker://{registry}/lib/{name}:v1")
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("a", "b"):
        (specs / f"t{name}.yaml").write_text(
            f'layer: t{name}\nversion: "1"\nfrom: ["oci:{registry}/lib/{name}:v1"]\n'
            'steps:\n  - run: "busybox cat /srv/*.txt > /seen.txt"\n')
        (specs / f"i{name}.yaml").write_text(
            f'image: i{name}\nversion: "1"\nlayers: ["oci:{registry}/lib/{name}:v1", '
            f't{name}@1]\n')
    report = json.loads(run_dsec("build", str(specs), "--json").stdout)
    assert set(report["pinned"]) == {f"oci:{registry}/lib/{n}:v1" for n in "ab"}
    for name in ("a", "b"):
        images.export_image(f"i{name}@1", tmp_path / f"tree-{name}")
        assert (tmp_path / f"tree-{name}/seen.txt").read_text() == name  # its own image only
    (specs / "tc.yaml").write_text(
        f'layer: tc\nversion: "1"\n\nfrom: ["oci:{registry}/lib/none:v1"]\n'
        'steps:\n  - run: "true"\n')
    p = run_dsec("build", str(specs), check=2)
    assert "lib/none:v1" in p.stderr and "tc.yaml:4:" in " ".join(p.stderr.split()), p.stderr
