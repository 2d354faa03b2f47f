"""The import contract: data flows one way (DESIGN.md §1, docs/architecture.md), so every
import inside dsec_cli points down the stack. Walks every module with `ast`, including
function-local imports, and fails on an edge the design does not allow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsec_cli"

#: stage -> the stages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    # framework adapters: the public API only, as a framework's user would (DESIGN.md §9b)
    "integrations": {"api", "core"},
    "cli": {"api", "core"},
    "api": {"run", "build", "backends", "push", "format", "core"},
    "run": {"backends", "build", "push", "format", "core"},
    "build": {"backends", "push", "format", "core"},
    "backends": {"core"},
    "push": {"format", "core"},
    "format": {"core"},
    "core": set(),
}

#: the package root re-exports the API lazily; `python -m dsec_cli` starts the CLI
ROOT_MODULES = {"dsec_cli": {"api", "core"}, "dsec_cli.__main__": {"cli"}}

#: edges that stay, each with the reason it is right
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every dsec_cli import in the file,
    wherever it appears (top level or inside a function)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names
                    if a.name.split(".")[0] == "dsec_cli"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "dsec_cli":
                continue
            names = [a.name for a in node.names]
            if target in ("dsec_cli",) + tuple(f"dsec_cli.{s}" for s in ALLOWED) \
                    or target.count(".") == 0:
                # `from .. import sdk`-style: the imported names may be submodules
                out += [(node.lineno, f"{target}.{n}" if target == "dsec_cli"
                         and n in ALLOWED else target, [n]) for n in names]
            else:
                out.append((node.lineno, target, names))
    return out


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = module_name(path)
        for line, target, names in imports(path):
            dst = stage(target)
            if target == "dsec_cli" and names == ["__version__"]:
                continue  # the package's version is metadata every stage may report
            allowed = ROOT_MODULES.get(src)
            if allowed is None:
                here = stage(src)
                if here is None:
                    found.append(f"{src}: a module outside the stages")
                    continue
                allowed = ALLOWED[here] | {here}
                if here == "integrations" and target == "dsec_cli":
                    continue  # the package root's re-exports are the public API (DESIGN.md §9b)
            if dst is None or dst not in allowed:
                edge = (src, target)
                if edge not in EXCEPTIONS:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} imports "
                                 f"{target} ({stage(src) or src} -> {dst or target})")
    return found


def test_imports_point_down_the_stack() -> None:
    assert violations() == []


def test_exceptions_are_still_needed() -> None:
    """A listed exception that no longer occurs is removed, so the list stays honest."""
    seen = {(module_name(p), t) for p in PACKAGE.rglob("*.py") for _, t, _ in imports(p)}
    assert [e for e in EXCEPTIONS if e not in seen] == []


@pytest.mark.parametrize("src, code, bad", [
    ("backends/x.py", "from ..push import stores\n", True),
    ("backends/x.py", "def f():\n    from ..run.node import Node\n", True),
    ("format/x.py", "import dsec_cli.push.api\n", True),
    ("cli/x.py", "from ..run import node\n", True),
    ("cli/x.py", "from ..api import sandboxes\n", False),
    ("run/x.py", "from ..build.layer import build_layer_from_dir\n", False),
    ("push/x.py", "from ..format.refs import resolve\n", False),
])
def test_the_walk_sees_each_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           src: str, code: str, bad: bool) -> None:
    """The checker itself catches an upward import at top level and inside a function."""
    pkg = tmp_path / "dsec_cli"
    f = pkg / src
    f.parent.mkdir(parents=True)
    f.write_text(code)
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", pkg)
    assert bool(violations()) is bad


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``os.environ.get("DSEC_...")``, ``os.environ["DSEC_..."]`` and
    ``os.getenv("DSEC_...")`` (f-strings included) in a module."""
    def dsec_name(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            text = arg.value
        elif isinstance(arg, ast.JoinedStr) and arg.values \
                and isinstance(arg.values[0], ast.Constant):
            text = str(arg.values[0].value) + "..."
        else:
            return None
        return text if text.startswith("DSEC_") else None

    def is_environ(e: ast.expr) -> bool:
        return isinstance(e, ast.Attribute) and e.attr == "environ"

    out = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in ("get", "pop", "setdefault") and is_environ(f.value)) \
                    or f.attr == "getenv":
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            arg = node.slice
        name = dsec_name(arg) if arg is not None else None
        if name:
            out.append((node.lineno, name))
    return out


def test_dsec_settings_are_read_in_config_only() -> None:
    """Every DSEC_* variable is read in core/config.py or core/settings.py, its light part
    (through `config.env` elsewhere), so one place lists every setting dsec looks at."""
    config = {PACKAGE / "core" / "config.py", PACKAGE / "core" / "settings.py"}
    found = [f"{p.relative_to(PACKAGE.parent)}:{line}: {name}"
             for p in sorted(PACKAGE.rglob("*.py")) if p not in config
             for line, name in _env_reads(ast.parse(p.read_text()))]
    assert found == []


def test_the_env_scan_sees_each_form() -> None:
    code = ('import os\nos.environ.get("DSEC_A")\nos.environ["DSEC_B"]\nos.getenv("DSEC_C")\n'
            'os.environ.get(f"DSEC_D_{x}")\nos.environ.get("HOME")\n')
    assert [n for _, n in _env_reads(ast.parse(code))] == ["DSEC_A", "DSEC_B", "DSEC_C",
                                                           "DSEC_D_..."]


def test_config_env_refuses_undeclared_settings() -> None:
    from dsec_cli.core.config import ENV_SETTINGS, env

    assert "DSEC_SSH_TIMEOUT" in ENV_SETTINGS
    with pytest.raises(KeyError):
        env("DSEC_NOT_A_SETTING")
