"""The package root is the SDK: every exported name resolves, lazily."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dsec_cli


def test_every_exported_name_resolves() -> None:
    for name in dsec_cli.__all__:
        obj = getattr(dsec_cli, name)
        if name == "__version__":
            assert isinstance(obj, str) and obj[0].isdigit(), obj
            continue
        # the real function or class of the SDK, not a placeholder
        assert callable(obj) and obj.__module__.startswith("dsec_cli."), (name, obj)


def test_cli_start_does_not_import_heavy_dependencies() -> None:
    code = ("import sys; from dsec_cli.cli import app; heavy = ('boto3', 'oras', 'fastcdc'); "
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sdk_builds_and_inspects(tmp_path: Path) -> None:
    spec = tmp_path / "s"
    (spec / "files").mkdir(parents=True)
    (spec / "files/x").write_text("x")
    (spec / "l.yaml").write_text('layer: l\nversion: "1"\nsteps:\n'
                                 "  - copy: {src: ./files, dst: /x}\n")
    store = str(tmp_path / "store")
    report = dsec_cli.build_specs([spec], store)
    assert [i.ref for i in report.items] == ["l@1"]
    doc = dsec_cli.inspect("l@1", store, files=True)
    assert {f["path"] for f in doc["files"]} == {".", "x", "x/x"}
