"""Each compiled part's report: live, off by its DSEC_* setting, not built, or built but not
loading, each with what runs instead."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.core import compiled
from dsec_cli.core.compiled import CompiledModule, module_status


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package on the path to put stand-in modules in."""
    (tmp_path / "cpkg").mkdir()
    (tmp_path / "cpkg/__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "cpkg"
    for name in [m for m in sys.modules if m == "cpkg" or m.startswith("cpkg.")]:
        del sys.modules[name]


def test_states(pkg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (pkg / "_good.py").write_text("")
    (pkg / "_bad.py").write_text("raise ImportError('undefined symbol: PyFoo')")
    monkeypatch.delenv("DSEC_PY_WALK", raising=False)

    def state(module: str, off: str = "") -> tuple[str, bool, str]:
        row = module_status(CompiledModule(module, "x.c", "the Python twin", off=off))
        assert row["fallback"] == "the Python twin"
        return row["state"], row["live"], row["detail"]

    assert state("cpkg._good") == ("live", True, "")
    assert state("cpkg._missing")[:2] == ("not built", False)
    assert state("cpkg._bad") == ("import error", False, "undefined symbol: PyFoo")
    assert state("nopkg._x")[:2] == ("import error", False)
    monkeypatch.setenv("DSEC_PY_WALK", "1")
    assert state("cpkg._good", off="DSEC_PY_WALK") == ("off", False, "$DSEC_PY_WALK is set")


def test_every_module_has_its_source() -> None:
    """The list is the package's: every ``_name.c`` (each an extension of setup.py) is named,
    and only those."""
    root = Path(compiled.__file__).parents[1]
    sources = {str(p.relative_to(root)) for p in root.rglob("_*.c")}
    assert {m.source for m in compiled.MODULES} == sources
    for m in compiled.MODULES:
        assert m.module == "dsec_cli." + m.source.removesuffix(".c").replace("/", ".")
