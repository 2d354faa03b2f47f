"""Layer and image specs: YAML files validated strictly, every error naming file and line."""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.digests import parse_ref
from ..core.errors import SpecError, UsageError
from ..core.units import parse_size
from ..format import canonical

OCI_PREFIX = "oci:"
LAYER_KEYS = {"layer", "version", "from", "steps", "env", "workdir", "description"}
IMAGE_KEYS = {"image", "version", "layers", "env", "workdir", "description", "task", "grade",
              "dockerfile", "build_args", "target", "squash"}
#: an image built from a Dockerfile (docs/dockerfile.md) takes these instead of `layers:`
DOCKERFILE_KEYS = {"dockerfile", "build_args", "target", "squash"}
#: an image's `task:` (the agent's image) and `grade:` (the grader's image) sections,
#: kept in the image manifest's annotations (docs/grader.md)
TASK_KEYS = {"patch", "protected"}
GRADE_KEYS = {"command", "results", "tests", "timeout", "memory", "pids", "cpus", "env",
              "reward"}
STEP_KEYS = {
    "copy": {"src", "dst", "owner", "mode", "keep_mtime", "made_by"},
    "extract": {"src", "dst", "owner", "keep_mtime", "made_by"},
    "run": {"cmd", "network", "env"},
    "git_scrub": {"path", "base"},
}


@dataclass
class Step:
    kind: str  # copy | extract | run
    args: dict[str, Any]
    line: int


@dataclass
class Spec:
    path: Path
    kind: str  # layer | image
    name: str
    version: str
    line: int
    deps: list[tuple[str, int]] = field(default_factory=list)  # (ref, line): from / layers
    steps: list[Step] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    description: str = ""
    doc: dict[str, Any] = field(default_factory=dict)  # the validated document
    task: dict[str, Any] = field(default_factory=dict)  # image: patch surface, protected paths
    grade: dict[str, Any] = field(default_factory=dict)  # image: how a grader scores
    #: image: a Dockerfile it is built from (`dockerfile:`), with its options
    dockerfile: Path | None = None
    build_args: dict[str, str] = field(default_factory=dict)
    target: str = ""
    squash: bool = False

    def annotations(self) -> dict[str, str]:
        """What an image manifest keeps of `task:` and `grade:`."""
        out = {}
        if self.task:
            out["dsec.task"] = canonical.dumps(self.task).decode()
        if self.grade:
            out["dsec.grade"] = canonical.dumps(self.grade).decode()
        return out

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def dir(self) -> Path:
        return self.path.parent.resolve()

    def digest(self) -> str:
        return hashlib.sha256(canonical.dumps(self.doc)).hexdigest()


class _Doc:
    """A YAML node tree turned into plain values, remembering each node's line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def err(self, node: yaml.Node | None, msg: str) -> SpecError:
        line = node.start_mark.line + 1 if node is not None else None
        return SpecError(msg, path=str(self.path), line=line)

    def load(self) -> yaml.MappingNode:
        from ..core import yamlfile

        def fail(message: str, line: int | None) -> SpecError:
            return SpecError(message, path=str(self.path), line=line)

        node = yamlfile.compose(self.path, fail)
        if not isinstance(node, yaml.MappingNode):
            raise self.err(node, "a spec must be a mapping with `layer:` or `image:`")
        return node

    def mapping(self, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.err(node, f"{what} must be a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise self.err(k, f"{what}: keys must be strings")
            if k.value in out:
                raise self.err(k, f"{what}: duplicate key {k.value!r}")
            out[k.value] = (k, v)
        return out

    def string(self, node: yaml.Node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode) or node.tag.endswith((":null", ":map", ":seq")):
            raise self.err(node, f"{what} must be a string")
        return str(node.value)

    def boolean(self, node: yaml.Node, what: str) -> bool:
        if not isinstance(node, yaml.ScalarNode) or not node.tag.endswith(":bool"):
            raise self.err(node, f"{what} must be true or false")
        return bool(yaml.safe_load(node.value))

    def strings(self, node: yaml.Node, what: str) -> list[tuple[str, yaml.Node]]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.err(node, f"{what} must be a list")
        return [(self.string(n, f"{what} entries"), n) for n in node.value]

    def env(self, node: yaml.Node) -> dict[str, str]:
        out = {}
        for key, (kn, vn) in self.mapping(node, "env").items():
            if not key or "=" in key:
                raise self.err(kn, f"env: invalid variable name {key!r}")
            out[key] = self.string(vn, f"env.{key}")
        return out


def _check_unknown(d: _Doc, keys: dict[str, tuple[yaml.Node, yaml.Node]], allowed: set[str],
                   what: str) -> None:
    for key, (kn, _) in keys.items():
        if key not in allowed:
            raise d.err(kn, f"unknown key {key!r} in {what}; allowed: {', '.join(sorted(allowed))}")


def _name_version(d: _Doc, keys: dict[str, tuple[yaml.Node, yaml.Node]], kind: str,
                  top: yaml.Node) -> tuple[str, str]:
    if "version" not in keys:
        raise d.err(top, f"missing `version:` for {kind} spec")
    name = d.string(keys[kind][1], kind)
    version = d.string(keys["version"][1], "version")
    try:
        parse_ref(f"{name}@{version}")
    except UsageError as e:
        raise d.err(keys[kind][1], e.message) from None
    return name, version


def _inside(d: _Doc, node: yaml.Node, spec_dir: Path, src: str, made_by: str = "") -> Path:
    """``src`` of the spec's folder, which must exist; ``made_by`` names what makes a src
    that is not committed (a missing one's error says to run it: a build never runs it)."""
    if posixpath.isabs(src):
        raise d.err(node, f"src {src!r} must be relative to the spec's folder")
    host = (spec_dir / src).resolve()
    root = spec_dir.resolve()
    if host != root and root not in host.parents:
        raise d.err(node, f"src {src!r} escapes the spec's folder")
    if not host.exists():
        made = (f": it is made by {made_by!r} in the spec's folder, run that first "
                "(`make demo` and scripts/setup.sh do)" if made_by else "")
        raise d.err(node, f"src {src!r} does not exist ({host}){made}")
    return host


def _dst(d: _Doc, node: yaml.Node, dst: str) -> str:
    if not dst.startswith("/"):
        raise d.err(node, f"dst {dst!r} must be an absolute path in the layer")
    norm = posixpath.normpath(dst)
    if any(p == ".." for p in dst.split("/")):
        raise d.err(node, f"dst {dst!r} escapes /")
    return "/" if norm in ("/", "//") else norm


def _owner(d: _Doc, node: yaml.Node, text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        uid = int(parts[0])
        gid = int(parts[1]) if len(parts) == 2 else uid
        if len(parts) > 2 or uid < 0 or gid < 0:
            raise ValueError
    except ValueError:
        raise d.err(node, f"owner {text!r} must be UID or UID:GID (numbers)") from None
    return uid, gid


def _step(d: _Doc, node: yaml.Node, spec_dir: Path) -> tuple[Step, dict[str, Any]]:
    keys = d.mapping(node, "step")
    if len(keys) != 1:
        raise d.err(node, f"a step has exactly one of: {', '.join(STEP_KEYS)}")
    kind, (kn, vn) = next(iter(keys.items()))
    if kind not in STEP_KEYS:
        raise d.err(kn, f"unknown step {kind!r}; steps are: {', '.join(STEP_KEYS)}")
    line = kn.start_mark.line + 1
    if kind == "run" and isinstance(vn, yaml.ScalarNode):
        cmd = d.string(vn, "run")
        return Step("run", {"cmd": cmd, "network": False, "env": {}}, line), {"run": cmd}
    if kind == "git_scrub":
        return _git_scrub_step(d, vn, line)
    args = d.mapping(vn, kind)
    _check_unknown(d, args, STEP_KEYS[kind], f"{kind} step")
    doc: dict[str, Any] = {}
    out: dict[str, Any] = {}
    if kind == "run":
        if "cmd" not in args:
            raise d.err(vn, "run step needs `cmd:`")
        out["cmd"] = doc["cmd"] = d.string(args["cmd"][1], "run.cmd")
        out["network"] = d.boolean(args["network"][1], "run.network") if "network" in args \
            else False
        out["env"] = d.env(args["env"][1]) if "env" in args else {}
        doc.update(network=out["network"], env=out["env"])
        return Step(kind, out, line), {kind: doc}
    for req in ("src", "dst"):
        if req not in args:
            raise d.err(vn, f"{kind} step needs `{req}:`")
    src_node = args["src"][1]
    src = d.string(src_node, f"{kind}.src")
    # documentation of the spec, not what it builds: left out of the spec's digest
    made_by = d.string(args["made_by"][1], f"{kind}.made_by") if "made_by" in args else ""
    out["src"] = _inside(d, src_node, spec_dir, src, made_by)
    out["dst"] = _dst(d, args["dst"][1], d.string(args["dst"][1], f"{kind}.dst"))
    doc.update(src=src, dst=out["dst"])
    if kind == "extract":
        name = out["src"].name
        if out["src"].is_dir() or not name.endswith((".tar", ".tar.gz", ".tgz", ".tar.zst",
                                                     ".tar.xz")):
            raise d.err(src_node, f"extract src {src!r} must be a .tar, .tar.gz, .tar.zst "
                        "or .tar.xz file")
    # what a copy or extract writes is the same wherever the spec is checked out: fixed
    # timestamps (SOURCE_DATE_EPOCH, else 0) unless `keep_mtime: true`; copies are owned by
    # root unless `owner:` says otherwise (an archive keeps the owners it records)
    if "owner" in args:
        out["owner"] = _owner(d, args["owner"][1], d.string(args["owner"][1], f"{kind}.owner"))
        doc["owner"] = list(out["owner"])
    if "keep_mtime" in args:
        out["keep_mtime"] = d.boolean(args["keep_mtime"][1], f"{kind}.keep_mtime")
        if out["keep_mtime"]:  # the default adds nothing: `false` and absent are one spec
            doc["keep_mtime"] = True
    if "mode" in args:
        text = d.string(args["mode"][1], "copy.mode")
        try:
            out["mode"] = int(text, 8)
            if not 0 <= out["mode"] <= 0o7777:
                raise ValueError
        except ValueError:
            raise d.err(args["mode"][1], f"mode {text!r} must be octal, e.g. '0755'") from None
        doc["mode"] = out["mode"]
    return Step(kind, out, line), {kind: doc}


def _git_scrub_step(d: _Doc, node: yaml.Node, line: int) -> tuple[Step, dict[str, Any]]:
    """``git_scrub: /testbed`` or ``git_scrub: {path: /testbed, base: REV}``: the repository
    at ``path`` reduced to one commit holding the tree of ``base`` (default HEAD)."""
    path_node: yaml.Node
    base_node: yaml.Node | None = None
    if isinstance(node, yaml.ScalarNode):
        path_node = node
    else:
        args = d.mapping(node, "git_scrub")
        _check_unknown(d, args, STEP_KEYS["git_scrub"], "git_scrub step")
        if "path" not in args:
            raise d.err(node, "git_scrub step needs `path:`")
        path_node = args["path"][1]
        if "base" in args:
            base_node = args["base"][1]
    path = _dst(d, path_node, d.string(path_node, "git_scrub.path"))
    base = d.string(base_node, "git_scrub.base") if base_node is not None else "HEAD"
    if not base or base.startswith("-") or any(c in base for c in "\0\n\t "):
        raise d.err(base_node, f"git_scrub.base {base!r} is not a git revision")
    doc = {"path": path, "base": base}
    return Step("git_scrub", dict(doc), line), {"git_scrub": doc}


def _patterns(d: _Doc, node: yaml.Node, what: str) -> list[str]:
    out = []
    for text, n in d.strings(node, what):
        if not text or "\0" in text or ".." in text.split("/"):
            raise d.err(n, f"{what}: {text!r} must be a path or glob without `..`")
        out.append(text)
    return out


def _task(d: _Doc, node: yaml.Node) -> dict[str, Any]:
    keys = d.mapping(node, "task")
    _check_unknown(d, keys, TASK_KEYS, "task")
    if "patch" not in keys:
        raise d.err(node, "task needs `patch:` (the paths or globs an agent's patch may change)")
    out = {"patch": _patterns(d, keys["patch"][1], "task.patch")}
    if not out["patch"]:
        raise d.err(keys["patch"][1], "task.patch must name at least one path or glob")
    if "protected" in keys:
        out["protected"] = _patterns(d, keys["protected"][1], "task.protected")
    return out


def _number(d: _Doc, node: yaml.Node, what: str, low: float, high: float) -> float:
    text = d.string(node, what)
    try:
        value = float(text)
        if not low <= value <= high:
            raise ValueError
    except ValueError:
        raise d.err(node, f"{what} {text!r} must be a number from {low:g} to {high:g}"
                    ) from None
    return value


def _grade(d: _Doc, node: yaml.Node) -> dict[str, Any]:
    keys = d.mapping(node, "grade")
    _check_unknown(d, keys, GRADE_KEYS, "grade")
    if "command" not in keys:
        raise d.err(node, "grade needs `command:` (what runs the hidden tests)")
    out: dict[str, Any] = {"command": d.string(keys["command"][1], "grade.command")}
    if "results" in keys:
        out["results"] = _dst(d, keys["results"][1], d.string(keys["results"][1],
                                                              "grade.results"))
    if "tests" in keys:
        out["tests"] = [t for t, _ in d.strings(keys["tests"][1], "grade.tests")]
    if "timeout" in keys:
        out["timeout"] = _number(d, keys["timeout"][1], "grade.timeout", 1, 86400)
    if "cpus" in keys:
        out["cpus"] = _number(d, keys["cpus"][1], "grade.cpus", 0.01, 1024)
    if "pids" in keys:
        out["pids"] = int(_number(d, keys["pids"][1], "grade.pids", 2, 1 << 22))
    if "memory" in keys:
        text = d.string(keys["memory"][1], "grade.memory")
        try:
            out["memory"] = parse_size(text, "grade.memory")
        except UsageError as e:
            raise d.err(keys["memory"][1], e.message) from None
    if "env" in keys:
        out["env"] = d.env(keys["env"][1])
    if "reward" in keys:
        out["reward"] = d.string(keys["reward"][1], "grade.reward")
        if out["reward"] not in ("all", "fraction"):
            raise d.err(keys["reward"][1], "grade.reward must be `all` (1 only when every "
                        "test passes) or `fraction` (the share of tests that pass)")
    return out


def _dockerfile_keys(d: _Doc, keys: dict[str, tuple[yaml.Node, yaml.Node]], spec: Spec,
                     doc: dict[str, Any]) -> None:
    """`dockerfile: PATH` (relative to the spec's folder, which it may not leave) with
    `build_args:`, `target:` and `squash:`; env and workdir come from the Dockerfile."""
    for key in ("env", "workdir", "task", "grade"):
        if key in keys:
            raise d.err(keys[key][0], f"`{key}:` does not go with `dockerfile:` (the "
                        "Dockerfile says it)" if key in ("env", "workdir") else
                        f"`{key}:` does not go with `dockerfile:`")
    node = keys["dockerfile"][1]
    text = d.string(node, "dockerfile")
    path = _inside(d, node, spec.path.parent, text)
    if path.is_dir():
        path = path / "Dockerfile"
    if not path.is_file():
        raise d.err(node, f"dockerfile {text!r} is not a file")
    from .dockerfile import load_dockerfile

    load_dockerfile(path)  # checked with the specs, before anything is built
    spec.dockerfile = path
    if "build_args" in keys:
        spec.build_args = d.env(keys["build_args"][1])
    if "target" in keys:
        spec.target = d.string(keys["target"][1], "target")
    if "squash" in keys:
        spec.squash = d.boolean(keys["squash"][1], "squash")
    doc.update(dockerfile=text, build_args=spec.build_args, target=spec.target,
               squash=spec.squash)


def load_spec(path: Path) -> Spec:
    d = _Doc(path)
    top = d.load()
    keys = d.mapping(top, "spec")
    kind = "layer" if "layer" in keys else "image" if "image" in keys else None
    if kind is None or ("layer" in keys and "image" in keys):
        raise d.err(top, "a spec has exactly one of `layer:` or `image:`")
    _check_unknown(d, keys, LAYER_KEYS if kind == "layer" else IMAGE_KEYS, f"{kind} spec")
    name, version = _name_version(d, keys, kind, top)
    spec = Spec(path=path, kind=kind, name=name, version=version, line=top.start_mark.line + 1)
    doc: dict[str, Any] = {kind: name, "version": version}
    if kind == "image" and "layers" in keys and "dockerfile" in keys:
        raise d.err(keys["dockerfile"][0], "an image spec has `layers:` or `dockerfile:`, "
                    "not both")
    for key in DOCKERFILE_KEYS - {"dockerfile"}:
        if key in keys and "dockerfile" not in keys:
            raise d.err(keys[key][0], f"`{key}:` goes with `dockerfile:`")
    dep_key = "from" if kind == "layer" else "layers"
    if dep_key in keys:
        for ref, n in d.strings(keys[dep_key][1], dep_key):
            try:
                if ref.startswith(OCI_PREFIX):  # an OCI image, imported on demand
                    # the OCI sources are loaded for `oci:` references only
                    from ..oci.sources import parse_image_ref

                    parse_image_ref(ref[len(OCI_PREFIX):])
                else:
                    parse_ref(ref)
            except UsageError as e:
                raise d.err(n, e.message) from None
            spec.deps.append((ref, n.start_mark.line + 1))
    elif kind == "image" and "dockerfile" in keys:
        _dockerfile_keys(d, keys, spec, doc)
    elif kind == "image":
        raise d.err(top, "image spec needs `layers:` (or `dockerfile:`)")
    doc[dep_key] = [r for r, _ in spec.deps]
    if "env" in keys:
        spec.env = d.env(keys["env"][1])
    if "workdir" in keys:
        spec.workdir = _dst(d, keys["workdir"][1], d.string(keys["workdir"][1], "workdir"))
    if "description" in keys:
        spec.description = d.string(keys["description"][1], "description")
    for key, parse in (("task", _task), ("grade", _grade)):
        if key in keys:
            setattr(spec, key, parse(d, keys[key][1]))
            doc[key] = getattr(spec, key)
    if kind == "layer":
        steps_node = keys["steps"][1] if "steps" in keys else None
        if steps_node is None:
            raise d.err(top, "layer spec needs `steps:`")
        if not isinstance(steps_node, yaml.SequenceNode) or not steps_node.value:
            raise d.err(steps_node, "steps must be a non-empty list")
        docs = []
        for n in steps_node.value:
            step, sdoc = _step(d, n, path.parent)
            spec.steps.append(step)
            docs.append(sdoc)
        doc["steps"] = docs
    doc.update(env=spec.env, workdir=spec.workdir)
    spec.doc = doc
    return spec


def find_specs(paths: list[Path]) -> list[Path]:
    """Spec files named directly, plus the *.yaml / *.yml files in a named directory and in
    its immediate subdirectories (``layerspecs/<name>/<name>.yaml``). Deeper folders are
    sources (trees to copy), never searched: they may hold YAML files of their own."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = [*p.glob("*.yaml"), *p.glob("*.yml"), *p.glob("*/*.yaml"),
                     *p.glob("*/*.yml")]
            out += sorted(x for x in found if x.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"no such spec file or directory: {p}")
    if not out:
        raise UsageError(f"no layer specs (*.yaml) found in {', '.join(map(str, paths))}")
    return out
