"""The import contract (docs/architecture.md, "Layers"): data flows one way, so every import
inside dsec_cli points down the stack, and no two modules import each other. Walks every
module with `ast`, including function-local imports, and fails on an edge the layers do not
allow or on an import cycle that is not one of the known ones."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsec_cli"

#: stage -> the stages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    # framework adapters: the public API only, as a framework's user would
    "integrations": {"api", "core"},
    "cli": {"api", "core"},
    "api": {"run", "build", "oci", "backends", "push", "format", "core"},
    "run": {"backends", "build", "oci", "push", "format", "core"},
    "build": {"backends", "oci", "push", "format", "core"},
    # OCI images and registries: sources, image documents, streams, export, the oci://
    # store, an image's run settings; `dsec import` writes layers with build's writer
    "oci": {"backends", "push", "format", "core"},
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
                    continue  # the package root's re-exports are the public API
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


# -- import cycles ---------------------------------------------------------------------------
#: An import inside a function defers loading a module until it is needed (so `dsec --help`
#: and a no-op build stay cheap, and an optional dependency is loaded only by what uses it);
#: it never keeps a circle open: with those imports counted, the graph has no cycle either.


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(body: list[ast.stmt], in_function: bool
                     ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import, whether inside a function) for every import that runs: those under
    ``if TYPE_CHECKING:`` never do."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_imports(node.orelse, in_function)
        else:
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _runtime_imports([child], inner)
                elif isinstance(child, ast.excepthandler | ast.match_case):
                    yield from _runtime_imports(child.body, inner)


def import_graph(functions: bool) -> dict[str, set[str]]:
    """module -> the dsec_cli modules it imports when it runs (``from pkg import sub`` is
    an edge to the submodule); with ``functions``, imports inside functions count too."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    # compiled modules (their C source, or a build of it) import nothing of dsec_cli
    compiled = {module_name(p.with_name(p.name.partition(".")[0] + ".py"))
                for pattern in ("_*.c", "_*.so") for p in PACKAGE.rglob(pattern)}
    graph: dict[str, set[str]] = dict.fromkeys(compiled - paths.keys(), set())
    known = paths.keys() | compiled
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _runtime_imports(tree.body, False):
            if in_function and not functions:
                continue
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in known}
                continue
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target in known:
                out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                        for a in node.names}
        out.discard(name)
        graph[name] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                members = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    members.add(w)
                    if w == v:
                        break
                if len(members) > 1:
                    found.add(frozenset(members))
    return found


def test_no_import_cycle_at_module_level() -> None:
    """Importing any module never needs a module that is still being imported."""
    assert sorted(sorted(c) for c in cycles(import_graph(functions=False))) == []


def test_no_import_cycle_through_functions_either() -> None:
    """No import inside a function dodges a circle: counting them, there is none."""
    assert sorted(sorted(c) for c in cycles(import_graph(functions=True))) == []


@pytest.mark.parametrize("a, b, at_module_level, anywhere", [
    ("from . import b\n", "from . import a\n", True, True),
    ("from .b import f\n", "def g():\n    from .a import h\n", False, True),
    ("from .b import f\n", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from .a import h\n", False, False),
    ("import dsec_cli.format.b\n", "try:\n    from .a import x\nexcept ImportError:\n"
     "    pass\n", True, True),
    ("from .b import f\n", "from .c import g\n", False, False),
])
def test_the_cycle_check_sees_each_kind_of_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, a: str, b: str,
        at_module_level: bool, anywhere: bool) -> None:
    """A circle through module-level imports, one through a function-local import, and
    none through a type-only import."""
    pkg = tmp_path / "dsec_cli" / "format"
    pkg.mkdir(parents=True)
    for name, code in (("__init__", ""), ("a", a), ("b", b), ("c", "")):
        (pkg / f"{name}.py").write_text(code)
    (pkg.parent / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", pkg.parent)
    ab = {frozenset({"dsec_cli.format.a", "dsec_cli.format.b"})}
    assert cycles(import_graph(functions=False)) == (ab if at_module_level else set())
    assert cycles(import_graph(functions=True)) == (ab if anywhere else set())


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


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """What importing ``start`` loads: its module-level imports, transitively, with the
    packages above each module (Python runs a package's ``__init__`` before its modules)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        parts = m.split(".")
        for up in [".".join(parts[:i]) for i in range(1, len(parts))] + [m]:
            if up in graph and up not in seen:
                seen.add(up)
                todo.extend(graph[up])
    return seen


def test_imports_inside_functions_defer_something() -> None:
    """An import inside a function of a module that importing the module loads anyway defers
    nothing: it belongs at the top."""
    top = import_graph(functions=False)
    full = import_graph(functions=True)
    idle = sorted(f"{m} -> {t}" for m in top for t in full[m] - top[m]
                  if t in _closure(top, m) and not t.startswith(f"{m}."))
    assert idle == []
