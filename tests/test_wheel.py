"""A wheel of dsec (a plain `pip install`, not editable) carries everything `dsec run` needs:
built offline from the tracked files, it holds every compiled module and the static agent and
leaves the source tree clean; installed into a fresh venv and run from a folder outside the
checkout, `dsec node check --host` reports them all live and it runs a sandbox. The same
tree unbuilt says each part falls back, and compiles its agent into DSEC_DATA_DIR."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsec_cli.core.compiled import MODULES

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def _sh(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]
    assert p.returncode == 0, f"{' '.join(cmd)}: {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def _tracked_copy(dest: Path) -> list[str]:
    """The tracked files only, copied to ``dest``: nothing built in the checkout goes along."""
    files = [f for f in _sh("git", "-C", str(REPO), "ls-files", "-z").stdout.split("\0")
             if f and (REPO / f).is_file()]
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        (dest / f).write_bytes((REPO / f).read_bytes())
    return files


def _untracked(src: Path, tracked: list[str]) -> list[str]:
    have = {str(p.relative_to(src)) for p in src.rglob("*") if not p.is_dir()}
    return sorted(have - set(tracked))


def _compiled(python: str, cwd: Path, env: dict[str, str]) -> dict[str, object]:
    out = _sh(python, "-m", "dsec_cli", "node", "check", "--host", "--json", cwd=cwd, env=env)
    return json.loads(out.stdout)["compiled"]  # type: ignore[no-any-return]


def test_installed_wheel_runs_a_sandbox(tmp_path: Path, busybox_tar: Path) -> None:
    src = tmp_path / "src"
    tracked = _tracked_copy(src)
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", str(tmp_path / "dist"), str(src))
    # the build's scratch (build/, *.egg-info) went elsewhere
    assert _untracked(src, tracked) == []
    wheel = next((tmp_path / "dist").glob("dsec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for need in ("dsec_cli/backends/sandbox_agent/dsec-agent",
                 "dsec_cli/backends/sandbox_agent/.dsec-agent.tag",
                 "dsec_cli/backends/vm/guest/init.sh", "dsec_cli/backends/_fnworker.py"):
        assert need in names, f"{need} is not in {wheel.name}"
    for m in MODULES:
        stem = m.module.replace(".", "/") + "."
        assert any(n.startswith(stem) and n.endswith(".so") for n in names), \
            f"{m.module} is not built in {wheel.name}"

    venv = tmp_path / "v"
    _sh(sys.executable, "-m", "venv", "--without-pip", str(venv))
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    vsite = venv / "lib" / pyver / "site-packages"
    # the dependencies come from this environment's site-packages, after the wheel's own
    # files, so that no other copy of dsec_cli (an editable install) can shadow the wheel
    with zipfile.ZipFile(wheel) as z:
        z.extractall(vsite)
        for info in z.infolist():  # file modes, as pip keeps them (the agent is executable)
            if info.external_attr >> 16:
                (vsite / info.filename).chmod(info.external_attr >> 16 & 0o777)
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
    parts = _compiled(str(venv / "bin/python"), work, env)
    assert [m["state"] for m in parts["modules"]] == ["live"] * len(MODULES), parts  # type: ignore[index]
    assert parts["agent"]["state"] == "built", parts  # type: ignore[index]
    assert parts["all_live"] is True
    _sh(str(launcher), "build", "spec", cwd=work, env=env)
    out = _sh(str(launcher), "run", "--backend", "fncall", "bb@1", "--", "echo", "hi from wheel",
              cwd=work, env=env)
    assert out.stdout == "hi from wheel\n"
    # the shipped agent ran: nothing was compiled on first use
    assert not list((tmp_path / "data").rglob("dsec-agent-*"))


def test_unbuilt_tree_falls_back(tmp_path: Path) -> None:
    """Run from its source without a build, every compiled module is reported as falling back
    to its Python twin, and the agent is compiled on first use into DSEC_DATA_DIR."""
    src = tmp_path / "src"
    _tracked_copy(src)
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSEC_", "XDG_"))}
    env.update(PYTHONPATH=str(src), DSEC_DATA_DIR=str(data),
               XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "xdg"))
    parts = _compiled(sys.executable, tmp_path, env)
    for m in parts["modules"]:  # type: ignore[attr-defined]
        assert (m["state"], m["live"]) == ("not built", False), m
        assert m["fallback"], m
    agent = parts["agent"]
    assert (agent["state"], agent["live"]) == ("not built", False), agent  # type: ignore[index]
    text = _sh(sys.executable, "-m", "dsec_cli", "node", "check", "--host", cwd=tmp_path,
               env=env).stdout
    assert "compiled: _walk      fallback  not built" in text, text
    path = _sh(sys.executable, "-c", "from dsec_cli.backends.sandbox_agent import agent_binary;"
               " print(agent_binary())", cwd=tmp_path, env=env).stdout.strip()
    assert Path(path).parent == data / "agent", path
    assert Path(path).is_file() and os.access(path, os.X_OK), path
    assert not (tmp_path / "xdg").exists()
    assert _compiled(sys.executable, tmp_path, env)["agent"]["state"] == "compiled"  # type: ignore[index]
