"""The one way dsec reads a YAML file (layer and image specs, config files): bounded before
PyYAML sees it and while it composes, so that a hostile file is an error naming it, never a
traceback, a deep recursion or an expansion without end.

A file must be valid UTF-8 of at most `MAX_BYTES`, nest at most `MAX_DEPTH` collections
deep, and expand to at most `MAX_NODES` nodes with every alias counted as a copy of what it
names (so a "billion laughs" file stops at the bound); an alias to a node that contains it
is refused. The caller chooses the error: ``fail(message, line)`` returns the `DsecError`
to raise (a `SpecError` for a spec, a `ConfigError` for a config file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DsecError

if TYPE_CHECKING:
    import yaml

MAX_BYTES = 16 << 20
MAX_DEPTH = 64
MAX_NODES = 1_000_000

Fail = Callable[[str, "int | None"], DsecError]


def compose(path: Path, fail: Fail) -> yaml.Node | None:
    """The node tree of the file's one document (None for an empty file), each node with
    its line (``node.start_mark.line``)."""
    return _read(path, fail, "get_single_node")


def load(path: Path, fail: Fail) -> Any:
    """The file's one document as plain values (None for an empty file)."""
    return _read(path, fail, "get_single_data")


def _read(path: Path, fail: Fail, step: str) -> Any:
    """The bounded loader's ``step`` (its single node or its single document), its
    refusals and YAML's errors raised as ``fail`` names them."""
    loader = _loader(path, fail)
    try:
        return getattr(loader, step)()
    except _Refused as e:
        raise fail(e.message, e.line) from None
    except _yaml().YAMLError as e:
        raise fail(*_described(e)) from e
    finally:
        loader.dispose()


def _yaml() -> Any:
    import yaml  # where a YAML file is read: commands that read none start without it

    return yaml


class _Refused(Exception):
    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def _text(path: Path, fail: Fail) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise fail(f"cannot read it: {e.strerror}", None) from e
    if len(data) > MAX_BYTES:
        raise fail(f"larger than {MAX_BYTES >> 20} MiB", None)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise fail(f"not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start})",
                   line) from None


def _loader(path: Path, fail: Fail) -> Any:
    yaml = _yaml()
    text = _text(path, fail)

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc,name-defined]
        """SafeLoader with a bound on nesting and on the size aliases expand to."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._depth = 0
            self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to, once complete

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            line = event.start_mark.line + 1
            alias = isinstance(event, yaml.AliasEvent)
            self._depth += 1
            try:
                if self._depth > MAX_DEPTH:
                    raise _Refused(f"nested more than {MAX_DEPTH} levels deep", line)
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if alias:
                if id(node) not in self._sizes:
                    raise _Refused(f"the alias *{event.anchor} refers to a node that "
                                   "contains it", line)
                return node
            children = (node.value if isinstance(node, yaml.SequenceNode) else
                        [n for kv in node.value for n in kv]
                        if isinstance(node, yaml.MappingNode) else [])
            size = 1 + sum(self._sizes[id(c)] for c in children)
            if size > MAX_NODES:
                raise _Refused(f"expands to more than {MAX_NODES} nodes (through aliases)",
                               line)
            self._sizes[id(node)] = size
            return node

    return BoundedLoader(text)


def _described(e: Exception) -> tuple[str, int | None]:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    return f"not valid YAML: {problem}", (mark.line + 1 if mark is not None else None)
