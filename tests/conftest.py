"""Fixtures shared by every test: an isolated home for dsec, a CLI runner, tree comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def skip_unless(ok: bool, reason: str):  # type: ignore[no-untyped-def]
    """A guard for a folder's conftest.py, assigned to a name there: every test of the folder
    is skipped (and reported as skipped) unless `ok`. `pytestmark` works in test modules only;
    pytest ignores it in a conftest.py."""

    @pytest.fixture(scope="session", autouse=True)
    def guard() -> None:
        if not ok:
            pytest.skip(reason)

    return guard


@pytest.fixture(autouse=True)
def dsec_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own data, config and state directories, never the user's."""
    home = tmp_path / "home"
    for var, sub in (("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "config")):
        (home / sub).mkdir(parents=True)
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("DSEC_STATE_DIR", str(home / "state"))
    for var in ("DSEC_STORE", "DSEC_DATA_DIR", "DSEC_CONFIG", "SOURCE_DATE_EPOCH"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def run_dsec(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Run the real `dsec` command line in a subprocess (the environment of the test)."""

    def run(*args: str, check: bool | int = True, cwd: Path | None = None,
            env: dict[str, str] | None = None, input: bytes | None = None
            ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", "from dsec_cli.cli import main; main()", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or REPO,
                           env={**os.environ, **(env or {}), "COLUMNS": "200"},
                           input=input.decode() if input else None, timeout=600)
        expected = 0 if check is True else check
        if check is not False and p.returncode != expected:
            raise AssertionError(f"dsec {' '.join(args)} exited {p.returncode}, wanted "
                                 f"{expected}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
        return p

    return run


@pytest.fixture(scope="session")
def busybox_tar() -> Path:
    """The example base layer's root filesystem tarball (made from busybox-static)."""
    script = REPO / "layerspecs/busybox/make-rootfs.sh"
    subprocess.run([str(script)], check=True)
    return REPO / "layerspecs/busybox/busybox-rootfs.tar"
