"""A wheel of dsec (a plain `pip install`, not editable) carries everything `dsec run` needs:
installed into a fresh venv and run from a folder outside the checkout, it builds its
in-sandbox agent from the shipped source into the user's data directory and runs a sandbox."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def _sh(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]
    assert p.returncode == 0, f"{' '.join(cmd)}: {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def test_installed_wheel_runs_a_sandbox(tmp_path: Path, busybox_tar: Path) -> None:
    src = tmp_path / "src"  # the tracked files only: nothing built in the checkout goes along
    files = _sh("git", "-C", str(REPO), "ls-files", "-z").stdout.split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes((REPO / f).read_bytes())
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", str(tmp_path / "dist"), str(src))
    wheel = next((tmp_path / "dist").glob("dsec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for need in ("dsec_cli/backends/sandbox_agent/dsec-agent.c",
                 "dsec_cli/backends/vm/guest/init.sh", "dsec_cli/backends/_fnworker.py"):
        assert need in names, f"{need} is not in {wheel.name}"

    venv = tmp_path / "v"
    _sh(sys.executable, "-m", "venv", "--without-pip", str(venv))
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    vsite = venv / "lib" / pyver / "site-packages"
    # the dependencies come from this environment's site-packages, after the wheel's own
    # files, so that no other copy of dsec_cli (an editable install) can shadow the wheel
    with zipfile.ZipFile(wheel) as z:
        z.extractall(vsite)
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (vsite / "zz-deps.pth").write_text("\n".join(deps) + "\n")
    launcher = venv / "bin" / "dsec"
    launcher.write_text(f"#!{venv / 'bin' / 'python'}\nfrom dsec_cli.cli import main\n"
                        "main()\n")
    launcher.chmod(0o755)

    work = tmp_path / "elsewhere"
    (work / "spec").mkdir(parents=True)
    (work / "spec/bb.yaml").write_text(
        'layer: bb\nversion: "1"\nsteps:\n  - extract: {src: ./rootfs.tar, dst: /}\n')
    (work / "spec/rootfs.tar").write_bytes(busybox_tar.read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "cfg"),
               DSEC_STATE_DIR=str(tmp_path / "state"), DSEC_STORE=str(tmp_path / "store"))
    where = _sh(str(venv / "bin/python"), "-c", "import dsec_cli; print(dsec_cli.__file__)",
                cwd=work, env=env).stdout.strip()
    assert where.startswith(str(vsite)), where
    _sh(str(launcher), "build", "spec", cwd=work, env=env)
    out = _sh(str(launcher), "run", "--backend", "fncall", "bb@1", "--", "echo", "hi from wheel",
              cwd=work, env=env)
    assert out.stdout == "hi from wheel\n"
    built = list((tmp_path / "data").rglob("dsec-agent-*"))
    assert built, "the agent was not built into the user's data directory"
