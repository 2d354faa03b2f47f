"""Bad command-line input to import and export: a clear error, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import store_files
from .helpers import Image, file, write_layout


@pytest.mark.parametrize("args,needle", [
    (["import", "/nonexistent/layout"], "no OCI layout or docker archive"),
    (["import", "127.0.0.1:1/Bad_Repo:v1"], "not a valid repository name"),
    (["import", "127.0.0.1:1/repo@sha256:abc"], "sha256:<64 hex>"),
    (["import", "127.0.0.1:1/repo:bad/tag!"], "not a valid"),
], ids=["missing-path", "bad-repo", "bad-digest", "bad-tag"])
def test_bad_import_sources(env: dict[str, str], args: list[str], needle: str,
                            run_dsec) -> None:  # type: ignore[no-untyped-def]
    p = run_dsec(*args, check=2)
    assert needle in " ".join(p.stderr.split()) and "Traceback" not in p.stderr


def test_bad_options_leave_the_store_and_destination_alone(env: dict[str, str],
                                                           tmp_path: Path,
                                                           run_dsec) -> None:  # type: ignore[no-untyped-def]
    write_layout(Image([[file("a", b"a")]]), tmp_path / "l")
    run_dsec("import", str(tmp_path / "l"), "--as", "a@1")
    before = store_files(env)
    for args, needle in (
        (["import", str(tmp_path / "l"), "--as", "no-version"], "NAME@VERSION"),
        (["export", "a@1", "--format", "zip", str(tmp_path / "o")], "choose tree or oci"),
        (["export", "a@1", "--format", "oci", "--compression", "lz4", str(tmp_path / "o")],
         "gzip or zstd"),
        (["export", "a@1", "--format", "oci"], "destination"),
    ):
        p = run_dsec(*args, check=2)
        assert needle in " ".join(p.stderr.split()), args
    assert not (tmp_path / "o").exists()
    assert store_files(env) == before
    # a different image under an existing name needs --replace
    write_layout(Image([[file("b", b"b")]]), tmp_path / "l2")
    p = run_dsec("import", str(tmp_path / "l2"), "--as", "a@1", check=2)
    assert "--replace" in " ".join(p.stderr.split())
    assert store_files(env) == before
    run_dsec("import", str(tmp_path / "l2"), "--as", "a@1", "--replace")
