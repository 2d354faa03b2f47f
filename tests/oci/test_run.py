"""An imported image runs with the container backend: its layers, env and workdir."""

from __future__ import annotations

from pathlib import Path

from .helpers import Image, file, write_layout


def test_imported_image_runs_in_a_container(node: dict[str, str], tmp_path: Path,
                                            busybox_tar: Path, run_dsec) -> None:  # type: ignore[no-untyped-def]
    img = Image([busybox_tar.read_bytes(), [file("work/task.txt", b"from the top layer\n")]],
                ["gzip", "zstd"], env=["PATH=/bin:/usr/bin", "GREETING=imported"],
                workdir="/work")
    write_layout(img, tmp_path / "layout")
    run_dsec("import", str(tmp_path / "layout"), "--as", "task@1")
    # the image's entrypoint is ["/bin/sh", "-c"]: the command given follows it
    p = run_dsec("run", "--backend", "container", "task@1", "--",
                 "echo $GREETING; pwd; cat task.txt")
    assert p.stdout == "imported\n/work\nfrom the top layer\n"
