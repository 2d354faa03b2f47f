"""Dockerfiles read into stages of checked instructions, every error naming the file and line.

dockerfile-parse (PyPI) splits the file into instructions (continuation lines, comments,
parser directives, line numbers); this module checks each one against what `dsec build`
supports (docs/dockerfile.md) before anything is built, and does the word splitting and
variable expansion of Docker's shell lexer (`$VAR`, `${VAR}`, `${VAR:-word}`,
`${VAR:+word}`, quotes, backslash escapes), which the parser leaves undone or does only in
part.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import SpecError

#: instructions a Dockerfile may hold here; any other is refused by line
SUPPORTED = {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "LABEL",
             "ENTRYPOINT", "CMD", "SHELL", "EXPOSE", "STOPSIGNAL", "MAINTAINER"}
#: flags each instruction takes (others are refused by name)
FLAGS = {"FROM": {"platform"}, "COPY": {"from", "chown", "chmod", "link"},
         "ADD": {"chown", "chmod", "link"}, "RUN": {"network"}}
#: the most bytes of a Dockerfile read
MAX_BYTES = 4 << 20
#: Docker's default SHELL
DEFAULT_SHELL = ["/bin/sh", "-c"]


@dataclass
class Instruction:
    op: str  # FROM, RUN, ...
    value: str  # the text after the instruction word, continuation lines joined
    line: int  # 1-based, where it starts
    flags: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    base: str  # an image ref, a stage name, or "scratch" (variables still unexpanded)
    name: str  # `AS NAME`, else ""
    index: int
    line: int
    body: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: list[Instruction]  # ARGs before the first FROM
    stages: list[Stage]

    def err(self, line: int, message: str) -> SpecError:
        return SpecError(message, path=str(self.path), line=line)

    def stage(self, target: str) -> Stage:
        """The stage ``--target`` names (a name or an index), else the last one."""
        if not target:
            return self.stages[-1]
        for s in self.stages:
            if s.name == target.lower() or str(s.index) == target:
                return s
        names = ", ".join(s.name or str(s.index) for s in self.stages)
        raise SpecError(f"{self.path}: no build stage {target!r} (stages: {names})")


def _split_flags(d: Dockerfile, ins: Instruction) -> None:
    """`--name=value` flags at the start of the value, checked against FLAGS."""
    text = ins.value
    while text.startswith("--"):
        word, _, rest = text.partition(" ")
        name, eq, value = word[2:].partition("=")
        if name not in FLAGS.get(ins.op, set()):
            what = ("mounts (--mount) are not supported" if name == "mount" else
                    f"the flag --{name} is not supported for {ins.op}")
            raise d.err(ins.line, f"{ins.op} {word}: {what}")
        if not eq or not value:
            raise d.err(ins.line, f"{ins.op} --{name} needs a value (--{name}=VALUE)")
        ins.flags[name] = value
        text = rest.lstrip()
    ins.value = text


def load_dockerfile(path: Path) -> Dockerfile:
    """Parse and check ``path``; nothing is built or fetched."""
    from dockerfile_parse import DockerfileParser

    try:
        data = path.read_bytes()[:MAX_BYTES + 1]
    except OSError as e:
        raise SpecError(f"cannot read the Dockerfile {path}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise SpecError(f"{path}: more than {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if "\0" in text:
        raise SpecError(f"{path}: holds a NUL byte")

    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    d = Dockerfile(path=path, global_args=[], stages=[])
    for item in parser.structure:
        op = item["instruction"].upper()
        ins = Instruction(op, item["value"].strip(), item["startline"] + 1)
        if op == "COMMENT":
            continue
        if op not in SUPPORTED:
            known = op in ("HEALTHCHECK", "ONBUILD", "VOLUME")
            raise d.err(ins.line, f"{op} is not supported by dsec build" if known else
                        f"unknown instruction {op!r}")
        if re.match(r"<<-?[\"']?[A-Za-z_]", ins.value) and op in ("RUN", "COPY", "ADD"):
            raise d.err(ins.line, f"{op}: here-documents (<<EOF) are not supported")
        _split_flags(d, ins)
        if op != "FROM" and not ins.value and op not in ("CMD", "ENTRYPOINT"):
            raise d.err(ins.line, f"{op} needs arguments")
        if op == "FROM":
            words = ins.value.split()
            if len(words) == 3 and words[1].lower() == "as":
                base, name = words[0], words[2].lower()
            elif len(words) == 1:
                base, name = words[0], ""
            else:
                raise d.err(ins.line, "FROM takes IMAGE [AS NAME]")
            if name and (not re.fullmatch(r"[a-z][a-z0-9_.-]*", name)
                         or any(s.name == name for s in d.stages)):
                raise d.err(ins.line, f"FROM ... AS {name}: a stage name must be new and "
                            "start with a letter")
            d.stages.append(Stage(base, name, len(d.stages), ins.line))
        elif not d.stages:
            if op != "ARG":
                raise d.err(ins.line, f"{op} before the first FROM (only ARG may come before)")
            d.global_args.append(ins)
        else:
            if op in ("SHELL",) or (op in ("CMD", "ENTRYPOINT") and ins.value.startswith("[")):
                json_list(d, ins)
            d.stages[-1].body.append(ins)
    if not d.stages:
        raise SpecError(f"{path}: no FROM instruction")
    return d


def json_list(d: Dockerfile, ins: Instruction) -> list[str]:
    """The exec form `["a", "b"]` of CMD, ENTRYPOINT, RUN and SHELL."""
    try:
        value = json.loads(ins.value)
    except ValueError:
        raise d.err(ins.line, f"{ins.op}: {ins.value!r} is not a JSON list of strings"
                    ) from None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise d.err(ins.line, f"{ins.op}: {ins.value!r} is not a JSON list of strings")
    if ins.op == "SHELL" and not value:
        raise d.err(ins.line, "SHELL needs at least one word")
    return value


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def words(text: str, env: dict[str, str], *, expand: bool = True) -> list[str]:
    """Docker's shell lexer: split on unquoted blanks, remove quotes, expand variables
    (not inside single quotes), keep a backslash-escaped character as it is."""
    out: list[str] = []
    cur: list[str] = []
    have = False
    i, n = 0, len(text)
    quote = ""
    while i < n:
        c = text[i]
        if quote != "'" and c == "\\" and i + 1 < n:
            cur.append(text[i + 1])
            i += 2
            have = True
            continue
        if quote:
            if c == quote:
                quote = ""
                i += 1
                continue
            if c == "$" and quote == '"' and expand:
                value, i = _variable(text, i, env)
                cur.append(value)
                continue
            cur.append(c)
            i += 1
            continue
        if c in "'\"":
            quote, have = c, True
            i += 1
            continue
        if c.isspace():
            if cur or have:
                out.append("".join(cur))
            cur, have = [], False
            i += 1
            continue
        if c == "$" and expand:
            value, i = _variable(text, i, env)
            cur.append(value)
            have = True
            continue
        cur.append(c)
        have = True
        i += 1
    if quote:
        raise ValueError(f"unterminated {quote} quote")
    if cur or have:
        out.append("".join(cur))
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Variables in ``text`` expanded, quotes kept (a RUN command's shell reads them)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] == "$":
            out.append("\\$")
            i += 2
        elif text[i] == "$":
            value, i = _variable(text, i, env)
            out.append(value)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _variable(text: str, i: int, env: dict[str, str]) -> tuple[str, int]:
    """The value of the variable at ``text[i] == "$"`` and the index after it."""
    if i + 1 < len(text) and text[i + 1] == "{":
        end = text.find("}", i + 2)
        if end < 0:
            raise ValueError("missing } in a ${...} expansion")
        inner = text[i + 2:end]
        m = _NAME.match(inner)
        if m is None:
            raise ValueError(f"bad substitution ${{{inner}}}")
        name, rest = m.group(), inner[m.end():]
        value = env.get(name)
        if rest.startswith(":-"):
            return (value if value else expand(rest[2:], env)), end + 1
        if rest.startswith(":+"):
            return (expand(rest[2:], env) if value else ""), end + 1
        if rest:
            raise ValueError(f"unsupported substitution ${{{inner}}}")
        return value or "", end + 1
    m = _NAME.match(text, i + 1)
    if m is None:
        return "$", i + 1
    return env.get(m.group(), ""), m.end()


def key_values(d: Dockerfile, ins: Instruction, env: dict[str, str]) -> list[tuple[str, str]]:
    """ENV's and LABEL's `K=V ...` (or ENV's old `K V`) with variables expanded."""
    try:
        if ins.op == "ENV" and "=" not in ins.value.split(None, 1)[0]:
            name, _, rest = ins.value.partition(" ")
            return [(name, " ".join(words(rest, env)) if rest.strip() else "")]
        out = []
        for w in words(ins.value, env):
            k, eq, v = w.partition("=")
            if not eq or not k:
                raise ValueError(f"{w!r} is not KEY=VALUE")
            out.append((k, v))
        return out
    except ValueError as e:
        raise d.err(ins.line, f"{ins.op}: {e}") from None


def split(d: Dockerfile, ins: Instruction, env: dict[str, str]) -> list[str]:
    """An instruction's words, expanded; a bad quote or substitution names the line."""
    try:
        return words(ins.value, env)
    except ValueError as e:
        raise d.err(ins.line, f"{ins.op}: {e}") from None


def is_dockerfile(path: Path) -> bool:
    """Whether `dsec build` reads ``path`` as a Dockerfile (by name: Dockerfile,
    Dockerfile.*, *.Dockerfile, *.dockerfile)."""
    name = path.name
    return path.is_file() and (name == "Dockerfile" or name.startswith("Dockerfile.")
                               or name.lower().endswith(".dockerfile"))
