"""`dsec build Dockerfile`: a Dockerfile's stages compiled into dsec layers and an image.

Each stage starts from an image of the store, an OCI image imported on the fly, another
stage or `scratch`. Every RUN, COPY, ADD and WORKDIR that changes files becomes one layer
(`--squash`: one layer for all of the target stage's), built in a staging upper dir over
the layers below it as `run` steps are (steps.StagedTree). A layer's key is the digest of
its parent's key, the instruction as expanded and the bytes it copies; the store's ref
``dockerfile-step@<key>`` names the layer built for it, so the same parent, instruction
and inputs are never built twice by anyone sharing the store, and the layer writer
deduplicates new layers' chunks against everything the store holds. The image config
(env, workdir, user, entrypoint, cmd, labels) goes through `oci.manifests.image_settings`,
the mapping `dsec import` uses, so `dsec run` starts the result as it starts an imported
image.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import logging
import os
import posixpath
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.config import load_config
from ..core.digests import parse_ref
from ..core.errors import BuildError, ConfigError, NotFoundError, SpecError, UsageError
from ..core.files import remove_tree
from ..format import canonical
from ..format.index import Entry
from ..format.manifest import load_manifest
from ..format.refs import commit_ref, get_ref
from ..format.tree import Scanned, scan_dir
from ..push.dedup import KnownChunks
from ..push.stores.base import Store
from .dockerfile import (
    DEFAULT_SHELL,
    Dockerfile,
    Instruction,
    Stage,
    json_list,
    key_values,
    load_dockerfile,
    split,
    words,
)
from .dockerfile import expand as expand_vars
from .report import BuildReport, Built

log = logging.getLogger(__name__)

STEP_NAME = "dockerfile-step"
#: bumped when what an instruction makes of its inputs changes (keys of older builds miss)
RULES = 1
#: RUN --network: the build's egress allowlist, the host's network, or none
NETWORKS = ("default", "host", "none")
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.xz")


@dataclass
class StageState:
    layers: list[str] = field(default_factory=list)  # manifest digests, bottom first
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    shell: list[str] = field(default_factory=lambda: list(DEFAULT_SHELL))
    stop_signal: str = ""
    key: str = ""


@dataclass
class DockerfileOptions:
    as_ref: str
    build_args: dict[str, str] = field(default_factory=dict)
    target: str = ""
    squash: bool = False
    context: Path | None = None  # default: the Dockerfile's folder


def _h(*parts: Any) -> str:
    return hashlib.sha256(canonical.dumps(list(parts))).hexdigest()


class _Builder:
    def __init__(self, d: Dockerfile, st: Store, opts: DockerfileOptions, report: BuildReport,
                 on_log: Callable[[str], None] | None, progress: Any) -> None:
        from ..push.materialize import LayerCache

        self.d, self.st, self.opts, self.report = d, st, opts, report
        self.on_log, self.progress = on_log, progress
        cfg = load_config()
        self.egress = _egress_rules(cfg)
        self.data_dir = Path(cfg.data_dir)
        self.cache = LayerCache(Path(cfg.state_dir))
        self.known: KnownChunks | None = None
        self.context = (opts.context or d.path.parent).resolve()
        self.ignore = _dockerignore(self.context)
        self.states: dict[int, StageState] = {}
        self.images: dict[str, str] = {}  # COPY --from image reference -> manifest digest
        self.dirs: dict[str, Path] = {}  # layer manifest digest -> cached tree

    # -- the stages ---------------------------------------------------------------------

    def global_args(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for ins in self.d.global_args:
            name, value = _arg(self.d, ins, out)
            out[name] = self.opts.build_args.get(name, value)
        return out

    def needed(self, target: Stage) -> list[Stage]:
        """The target and the stages it reads from, in file order."""
        want: set[int] = set()

        def visit(s: Stage) -> None:
            if s.index in want:
                return
            want.add(s.index)
            for ref in [s.base] + [i.flags["from"] for i in s.body if "from" in i.flags]:
                other = self._stage_named(ref)
                if other is not None and other.index < s.index:
                    visit(other)
        visit(target)
        return [s for s in self.d.stages if s.index in want]

    def _stage_named(self, ref: str) -> Stage | None:
        for s in self.d.stages:
            if (s.name and s.name == ref.lower()) or str(s.index) == ref:
                return s
        return None

    def stage(self, s: Stage, gargs: dict[str, str], squash: bool) -> StageState:
        try:
            base_ref = expand_vars(s.base, gargs)
        except ValueError as e:
            raise self.d.err(s.line, f"FROM: {e}") from None
        state = self.base(base_ref, s)
        args: dict[str, str] = {}
        squashed: list[tuple[Instruction, StageState, dict[str, str]]] = []
        for ins in s.body:
            scope = {**args, **state.env}  # a global ARG is seen where a stage declares it
            if ins.op == "ARG":
                name, value = _arg(self.d, ins, {**args, **state.env})
                if name in gargs and "=" not in ins.value:
                    value = gargs[name]
                args[name] = self.opts.build_args.get(name, value)
                continue
            if ins.op in ("RUN", "COPY", "ADD", "WORKDIR"):
                before = state.key
                self.config(ins, state, scope)  # WORKDIR's new dir; the others keep it
                state.key = _h(RULES, before, ins.op, ins.value, ins.flags, args,
                               self.inputs(ins, state, scope))
                if squash:
                    squashed.append((ins, _copy(state), dict(args)))
                else:
                    self.layer([(ins, _copy(state), dict(args))], state)
                continue
            self.config(ins, state, scope)
            state.key = _h(RULES, state.key, ins.op, ins.value, ins.flags)
        if squashed:
            self.layer(squashed, state)
        return state

    def base(self, ref: str, s: Stage) -> StageState:
        other = self._stage_named(ref)
        if other is not None:
            if other.index >= s.index:
                raise self.d.err(s.line, f"FROM {ref}: a stage can only build on one before it")
            return _copy(self.states[other.index])
        state = StageState()
        if ref == "scratch":
            state.key = _h(RULES, "scratch")
            return state
        digest = self.resolve_image(ref, s.line, "FROM ")
        m = load_manifest(self.st, digest)
        state.layers = list(m.layers) if m.kind == "image" else [digest]
        state.env = dict(m.env)
        state.workdir = m.workdir
        ann = m.annotations
        state.user = ann.get("oci.user", "")
        state.entrypoint = _json_ann(ann.get("oci.entrypoint"))
        state.cmd = _json_ann(ann.get("oci.cmd"))
        state.labels = {k[len("oci.label."):]: v for k, v in ann.items()
                        if k.startswith("oci.label.")}
        state.stop_signal = ann.get("oci.stop_signal", "")
        state.key = _h(RULES, "from", digest)
        return state

    def resolve_image(self, ref: str, line: int, what: str = "FROM") -> str:
        """A NAME@VERSION of the store, else an OCI reference imported now (layers the store
        has are not read again). ``what`` starts the errors (``FROM``, ``COPY --from=``)."""
        if "@" in ref and not ref.split("@", 1)[1].startswith("sha256:"):
            try:
                parse_ref(ref)
            except UsageError as e:
                raise self.d.err(line, f"{what}{ref}: {e.message}") from None
            try:
                return get_ref(self.st, ref).manifest
            except NotFoundError:
                raise self.d.err(line, f"{what}{ref}: no such image in {self.st.url}") from None
        from .ociimport import import_images

        run = import_images(self.st, [ref], as_ref="")
        if run.failed:
            failure = run.failed[0][1]
            if isinstance(failure, UsageError):
                raise self.d.err(line, f"{what}{ref}: {failure.message}") from None
            raise failure
        r = run.reports[0]
        self.report.pinned[ref] = r.source_digest
        return r.manifest

    # -- metadata ----------------------------------------------------------------------

    def config(self, ins: Instruction, state: StageState, scope: dict[str, str]) -> None:
        d, op = self.d, ins.op
        if op == "ENV":
            state.env.update(key_values(d, ins, scope))
        elif op == "LABEL":
            state.labels.update(key_values(d, ins, scope))
        elif op == "MAINTAINER":
            state.labels["maintainer"] = ins.value
        elif op == "WORKDIR":
            w = split(d, ins, scope)
            if len(w) != 1:
                raise d.err(ins.line, "WORKDIR takes one path")
            state.workdir = posixpath.normpath(posixpath.join(state.workdir or "/", w[0]))
        elif op == "USER":
            w = split(d, ins, scope)
            if len(w) != 1 or not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*(:[A-Za-z0-9_.-]+)?",
                                               w[0]):
                raise d.err(ins.line, f"USER {ins.value!r}: expected USER[:GROUP]")
            state.user = w[0]
        elif op == "SHELL":
            state.shell = json_list(d, ins)
        elif op in ("CMD", "ENTRYPOINT"):
            if ins.value.startswith("["):
                argv = json_list(d, ins)
            else:
                argv = [*state.shell, ins.value] if ins.value else []
            if op == "CMD":
                state.cmd = argv
            else:
                state.entrypoint = argv
                state.cmd = None  # as docker: an ENTRYPOINT resets the base image's CMD
        elif op == "STOPSIGNAL":
            state.stop_signal = split(d, ins, scope)[0]

    # -- inputs and layers -------------------------------------------------------------

    def inputs(self, ins: Instruction, state: StageState, scope: dict[str, str]) -> Any:
        """What besides the instruction's text the layer depends on."""
        if ins.op == "RUN":
            return {"env": state.env, "user": state.user, "workdir": state.workdir,
                    "shell": state.shell}
        if ins.op == "WORKDIR":
            return {"user": state.user}
        srcs, dest = self.copy_args(ins, state, scope)
        if "from" in ins.flags:
            other = self._stage_named(ins.flags["from"])
            source = (self.states[other.index].key if other is not None
                      else self.images[ins.flags["from"]])
            return {"from": source, "srcs": srcs, "dest": dest, "workdir": state.workdir}
        h = hashlib.sha256()
        for s in sorted(self.context_sources(ins, srcs)):
            h.update(s.encode("utf-8", "surrogateescape") + b"\0")
            p = self.context / s
            st = p.lstat()
            h.update(f"{st.st_mode:o}".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
            elif p.is_file():
                with open(p, "rb") as f:
                    while piece := f.read(1 << 20):
                        h.update(piece)
        return {"srcs": srcs, "dest": dest, "workdir": state.workdir, "files": h.hexdigest()}

    def copy_args(self, ins: Instruction, state: StageState, scope: dict[str, str]
                  ) -> tuple[list[str], str]:
        w = json_list(self.d, ins) if ins.value.startswith("[") else split(self.d, ins, scope)
        if len(w) < 2:
            raise self.d.err(ins.line, f"{ins.op} needs a source and a destination")
        for s in w[:-1]:
            if "://" in s:
                raise self.d.err(ins.line, f"{ins.op} {s}: URLs are not supported")
        return w[:-1], w[-1]

    def context_sources(self, ins: Instruction, srcs: list[str]) -> list[str]:
        """Every context path (relative) the sources reach, .dockerignore applied."""
        out: list[str] = []
        for pattern in srcs:
            norm = posixpath.normpath(pattern.lstrip("/")) or "."
            if norm == ".." or norm.startswith("../"):
                raise self.d.err(ins.line, f"{ins.op} {pattern}: outside the build context")
            matches = sorted(glob.glob(glob.escape(str(self.context)) + "/" + norm)
                             if glob.has_magic(norm) else
                             [str(self.context / norm)] if os.path.lexists(self.context / norm)
                             else [])
            matches = [m for m in matches if not self.ignored(_rel(self.context, m))]
            if not matches:
                raise self.d.err(ins.line, f"{ins.op} {pattern}: no such file in the build "
                                 f"context {self.context}")
            for m in matches:
                rel = _rel(self.context, m)
                out.append(rel)
                if os.path.isdir(m) and not os.path.islink(m):
                    for e in scan_dir(Path(m)):
                        if e.entry.path != ".":
                            sub = posixpath.join(rel, e.entry.path) if rel != "." else \
                                e.entry.path
                            if not self.ignored(sub):
                                out.append(sub)
        return out

    def ignored(self, rel: str) -> bool:
        return rel not in (".", "Dockerfile", ".dockerignore") and _matches(self.ignore, rel)

    def layer(self, items: list[tuple[Instruction, StageState, dict[str, str]]],
              state: StageState) -> None:
        """One layer from ``items`` (one instruction, or a stage's when squashed) over
        ``state.layers``; a layer the store already holds for the key is taken as it is."""
        key = state.key
        ref = f"{STEP_NAME}@{key}"
        try:
            digest = get_ref(self.st, ref).manifest
            m = load_manifest(self.st, digest)
            state.layers.append(digest)
            self.report.items.append(Built(ref, "layer", digest, m.content_digest, True,
                                           m.size, m.stored_size, spec=_where(self.d, items)))
            return
        except NotFoundError:
            pass

        from .layer import layer_manifest, write_layer
        from .steps import StagedTree, clean_stale_staging, make_staging, source_date_epoch

        started = time.monotonic()
        sde = source_date_epoch()
        tmp_root = self.data_dir / "tmp"
        clean_stale_staging(tmp_root)
        staging = make_staging(tmp_root)
        try:
            lowers = [self.tree(x) for x in state.layers]
            tree = StagedTree(staging, lowers)
            for n, (ins, at, args) in enumerate(items):
                self.apply(tree, ins, at, args, staging / f"in-{n}", sde)
            scanned = tree.scanned(sde)
            if self.known is None:
                self.known = KnownChunks.load(self.st, self.data_dir / "chunk-tables")
            index, stats = write_layer(self.st, scanned, known=self.known,
                                       progress=self.progress)
            self.known.add_index(index)
        finally:
            _umount_below(staging)
            remove_tree(staging)
        digest, m = layer_manifest(self.st, index, name=STEP_NAME, version=key,
                                   base=list(state.layers),
                                   created_by=f"Dockerfile {' '.join(i.op for i, _, _ in items)}")
        commit_ref(self.st, STEP_NAME, key, digest, replace=False,
                   verb="this Dockerfile build made")
        state.layers.append(digest)
        self.report.items.append(Built(ref, "layer", digest, m.content_digest, False, m.size,
                                       m.stored_size, stats.new_bytes, stats.new_chunks,
                                       stats.reused_chunks, time.monotonic() - started,
                                       spec=_where(self.d, items)))

    def tree(self, digest: str) -> Path:
        if digest not in self.dirs:
            self.dirs[digest] = self.cache.ensure(self.st, load_manifest(self.st, digest), digest)
        return self.dirs[digest]

    def apply(self, tree: Any, ins: Instruction, state: StageState, args: dict[str, str],
              spool: Path, sde: int) -> None:
        if ins.op == "WORKDIR":
            path = state.workdir.strip("/")
            if path and not tree.is_dir(path):
                uid, gid = self.ids(tree, state.user) if state.user else (0, 0)
                tree.add([Scanned(Entry(path, "dir", 0o755, uid, gid, sde), None)], sde,
                         _read_source)
            return
        if ins.op == "RUN":
            self.run(tree, ins, state, args)
            return
        self.copy(tree, ins, state, args, spool, sde)

    def run(self, tree: Any, ins: Instruction, state: StageState, args: dict[str, str]
            ) -> None:
        argv = json_list(self.d, ins) if ins.value.startswith("[") else [*state.shell, ins.value]
        network = ins.flags.get("network", "default")  # one of NETWORKS, checked up front
        if state.workdir and not tree.is_dir(state.workdir.strip("/")):
            tree.add([Scanned(Entry(state.workdir.strip("/"), "dir", 0o755, 0, 0, 0), None)],
                     0, _read_source)
        home = "/root"
        if state.user and state.user not in ("root", "0", "0:0", "root:root"):
            uid, gid = self.ids(tree, state.user)
            name = state.user.partition(":")[0]
            home = next((r[5] for r in _table(tree.read_file("etc/passwd"))
                         if (r[0] == name or r[2] == name) and len(r) > 5 and r[5]), "/")
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                    "--init-groups" if self.named(tree, state.user) else "--clear-groups",
                    "--", *argv]
        from .steps import DEFAULT_PATH

        env = {"PATH": DEFAULT_PATH, "HOME": home, **args, **state.env}
        code = tree.run_argv(argv, env=env, cwd=state.workdir or "/",
                             network=network != "none",
                             egress=self.egress if network == "default" else None,
                             on_line=self.on_log)
        if code != 0:
            raise BuildError(f"{self.d.path}:{ins.line}: RUN exited with code {code}: "
                             f"{ins.value[:200]!r}")

    def copy(self, tree: Any, ins: Instruction, state: StageState, args: dict[str, str],
             spool: Path, sde: int) -> None:
        srcs, dest = self.copy_args(ins, state, {**args, **state.env})
        dest_abs = posixpath.normpath(posixpath.join(state.workdir or "/", dest))
        # as docker: a directory when it says so, for several sources, or where one is
        into_dir = (dest.endswith("/") or dest in (".", "..") or len(srcs) > 1
                    or tree.is_dir(dest_abs.strip("/") or "."))
        chown = self.ids(tree, ins.flags["chown"]) if "chown" in ins.flags else None
        mode = int(ins.flags["chmod"], 8) if "chmod" in ins.flags else None
        if "from" in ins.flags:
            root = self.mount_stage(self.from_layers(ins.flags["from"]), spool)
        else:
            root = self.context
        scanned: list[Scanned] = []
        for pattern in srcs:
            norm = posixpath.normpath(pattern.lstrip("/")) or "."
            matches = (sorted(glob.glob(glob.escape(str(root)) + "/" + norm))
                       if glob.has_magic(norm) else [str(root / norm)])
            if root == self.context:
                matches = [m for m in matches if not self.ignored(_rel(root, m))]
            matches = [m for m in matches if os.path.lexists(m)]
            if not matches:
                raise self.d.err(ins.line, f"{ins.op} {pattern}: no such file")
            for m in matches:
                scanned += self.place(ins, Path(m), root, dest_abs,
                                      into_dir or len(matches) > 1, spool, sde)
        for s in scanned:
            if chown is not None:
                s.entry.uid, s.entry.gid = chown
            elif root == self.context:
                s.entry.uid = s.entry.gid = 0
            if mode is not None and s.entry.type != "sym":
                s.entry.mode = mode
            s.entry.mtime = sde
            if s.entry.xattrs:
                s.entry.xattrs = {k: v for k, v in s.entry.xattrs.items()
                                  if not k.startswith("security.")}
        tree.add(scanned, sde, _read_source)

    def place(self, ins: Instruction, src: Path, root: Path, dest: str, into_dir: bool,
              spool: Path, sde: int) -> list[Scanned]:
        rel = _rel(root, str(src))
        if ins.op == "ADD" and src.is_file() and src.name.endswith(ARCHIVES):
            from .tarball import read_tar

            spool.mkdir(parents=True, exist_ok=True)
            return read_tar(src, dest, spool / f"{len(os.listdir(spool))}")
        if src.is_dir() and not src.is_symlink():
            base = dest.strip("/")
            out = []
            for s in scan_dir(src):
                sub = posixpath.join(rel, s.entry.path) if s.entry.path != "." else rel
                if root == self.context and s.entry.path != "." and self.ignored(sub):
                    continue
                e = s.entry
                if e.path == ".":
                    e.path = base or "."
                else:
                    e.path = posixpath.join(base, e.path) if base else e.path
                if e.type == "hard":
                    e.target = posixpath.join(base, e.target) if base else e.target
                out.append(s)
            return out
        target = posixpath.join(dest, src.name) if into_dir else dest
        st = src.lstat()
        path = target.strip("/")
        if src.is_symlink():
            return [Scanned(Entry(path, "sym", 0o777, target=os.readlink(src), mtime=sde),
                            None)]
        return [Scanned(Entry(path, "reg", st.st_mode & 0o7777, mtime=sde, size=st.st_size),
                        str(src))]

    def copy_from_images(self, stages: list[Stage]) -> None:
        """Resolve every COPY --from of ``stages`` that names no stage: an image of the
        store (NAME@VERSION) or an OCI reference, imported now as FROM imports it. A plain
        word (no ``@``, ``:`` or ``/``) is taken for a misspelt stage name, not for
        ``docker.io/library/WORD:latest``."""
        for s in stages:
            for ins in s.body:
                ref = ins.flags.get("from")
                if ref is None or ref in self.images:
                    continue
                other = self._stage_named(ref)
                if other is not None:
                    if other.index >= s.index:
                        raise self.d.err(ins.line, f"{ins.op} --from={ref}: a stage can only "
                                         "copy from one before it")
                    continue
                if not re.search(r"[@:/]", ref):
                    raise self.d.err(ins.line, f"{ins.op} --from={ref}: no stage of that name "
                                     "before this one (an image is NAME@VERSION or an OCI "
                                     "reference with a tag, digest or registry)")
                self.images[ref] = self.resolve_image(ref, ins.line, f"{ins.op} --from=")

    def from_layers(self, ref: str) -> list[str]:
        """The layers (bottom first) a COPY --from reads: a stage's or an image's."""
        other = self._stage_named(ref)
        if other is not None:
            return self.states[other.index].layers
        m = load_manifest(self.st, self.images[ref])
        return list(m.layers) if m.kind == "image" else [self.images[ref]]

    def mount_stage(self, layers: list[str], spool: Path) -> Path:
        """A read-only overlay of a stage's or an image's layers (for COPY --from)."""
        point = spool / "from"
        point.mkdir(parents=True, exist_ok=True)
        empty = spool / "empty"
        empty.mkdir(exist_ok=True)
        lowers = [str(self.tree(x)) for x in reversed(layers)] + [str(empty)]
        if len(lowers) == 1:
            lowers.append(str(empty))
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            "ro,lowerdir=" + ":".join(lowers), str(point)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"cannot mount a stage for COPY --from: {r.stderr.strip()}")
        return point

    # -- users --------------------------------------------------------------------------

    def ids(self, tree: Any, spec: str) -> tuple[int, int]:
        """USER[:GROUP] (names or numbers) as ids, names read from the image's own files."""
        user, _, group = spec.partition(":")
        passwd = _table(tree.read_file("etc/passwd"))
        if user.isdigit():
            uid = int(user)
            gid = next((int(r[3]) for r in passwd if r[2] == user), 0)
        else:
            row = next((r for r in passwd if r[0] == user), None)
            if row is None:
                raise SpecError(f"user {user!r} is not in the image's /etc/passwd",
                                path=str(self.d.path))
            uid, gid = int(row[2]), int(row[3])
        if group:
            if group.isdigit():
                gid = int(group)
            else:
                grow = next((r for r in _table(tree.read_file("etc/group")) if r[0] == group),
                            None)
                if grow is None:
                    raise SpecError(f"group {group!r} is not in the image's /etc/group",
                                    path=str(self.d.path))
                gid = int(grow[2])
        return uid, gid

    def named(self, tree: Any, spec: str) -> bool:
        user = spec.partition(":")[0]
        return any(r[0] == user or r[2] == user for r in _table(tree.read_file("etc/passwd")))


def _egress_rules(cfg: Any) -> list[str]:
    """The config's ``build_egress`` (what RUN reaches without --network), each rule checked
    now, so a bad one stops the build before anything is made."""
    from ..backends.egress import parse_rule

    where = cfg.sources.get("build_egress", "the default")
    rules = cfg.build_egress
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise ConfigError(f"{where}: key 'build_egress' must be a list of HOST:PORT rules")
    for rule in rules:
        try:
            parse_rule(rule)
        except UsageError as e:
            raise ConfigError(f"{where}: key 'build_egress': {e.message}") from None
    return list(rules)


def _table(data: bytes | None) -> list[list[str]]:
    rows = []
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit() and (len(parts) < 7 or parts[3].isdigit()):
            rows.append(parts)
    return rows


def _copy(s: StageState) -> StageState:
    return StageState(list(s.layers), dict(s.env), s.workdir, s.user,
                      None if s.entrypoint is None else list(s.entrypoint),
                      None if s.cmd is None else list(s.cmd), dict(s.labels), list(s.shell),
                      s.stop_signal, s.key)


def _arg(d: Dockerfile, ins: Instruction, scope: dict[str, str]) -> tuple[str, str]:
    name, eq, default = ins.value.partition("=")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise d.err(ins.line, f"ARG {ins.value!r}: expected NAME[=DEFAULT]")
    try:
        value = " ".join(words(default, scope)) if eq else ""
    except ValueError as e:
        raise d.err(ins.line, f"ARG: {e}") from None
    return name, value


def _json_ann(text: str | None) -> list[str] | None:
    if text is None:
        return None
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return v if isinstance(v, list) and all(isinstance(x, str) for x in v) else None


def _rel(root: Path, path: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def _where(d: Dockerfile, items: list[tuple[Instruction, StageState, dict[str, str]]]) -> str:
    return f"{d.path}:{items[0][0].line}"


def _read_source(s: Scanned) -> Any:
    assert s.source is not None
    with open(s.source, "rb") as f:
        while piece := f.read(1 << 20):
            yield piece


def _umount_below(staging: Path) -> None:
    from .steps import _mounts_below

    for point in _mounts_below(staging):
        subprocess.run(["umount", "-l", point], capture_output=True)


# -- .dockerignore ---------------------------------------------------------------------------

def _dockerignore(context: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(exception, pattern) per line of the context's .dockerignore, as Docker reads it:
    comments and blanks skipped, `!` for exceptions, `**` for any number of dirs."""
    try:
        lines = (context / ".dockerignore").read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = posixpath.normpath(line.lstrip("!").strip().lstrip("/"))
        parts = []
        for piece in pat.split("/"):
            parts.append(".*" if piece == "**" else fnmatch.translate(piece)[4:-3])
        rx = "/".join(parts).replace(".*/", "(.*/)?")
        out.append((neg, re.compile(rf"(?s:{rx})(/.*)?\Z")))
    return out


def _matches(rules: list[tuple[bool, re.Pattern[str]]], rel: str) -> bool:
    """Excluded: the last rule that matches the path (or a parent of it) is not an
    exception."""
    out = False
    for neg, rx in rules:
        if rx.match(rel):
            out = not neg
    return out


def build_dockerfile(path: Path, store: Store, opts: DockerfileOptions, *,
                     replace: bool = False, progress: Any = None,
                     on_log: Callable[[str], None] | None = None) -> BuildReport:
    """Build ``path`` into ``store`` as the image ``opts.as_ref``. Every instruction is
    checked before anything is built; a failing RUN leaves the layers of the instructions
    before it (cached for the next build) and no image ref."""
    from ..oci.manifests import image_settings
    from .image import write_image

    name, version = parse_ref(opts.as_ref)
    d = load_dockerfile(path)
    target = d.stage(opts.target)
    report = BuildReport(store=store.url)
    b = _Builder(d, store, opts, report, on_log, progress)
    for s in d.stages:  # every stage checked before any is built
        for ins in s.body:
            net = ins.flags.get("network", "default") if ins.op == "RUN" else "default"
            if net not in NETWORKS:
                raise d.err(ins.line, f"RUN --network={net}: use default, host or none")
    gargs = b.global_args()
    stages = b.needed(target)
    b.copy_from_images(stages)  # images COPY --from names, resolved before anything is built
    for s in stages:
        b.states[s.index] = b.stage(s, gargs, opts.squash and s is target)
    state = b.states[target.index]
    config: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in state.env.items()],
                              "WorkingDir": state.workdir, "User": state.user,
                              "Labels": state.labels}
    if state.entrypoint is not None:
        config["Entrypoint"] = state.entrypoint
    if state.cmd is not None:
        config["Cmd"] = state.cmd
    if state.stop_signal:
        config["StopSignal"] = state.stop_signal
    env, workdir, ann = image_settings({"config": config}, str(path))
    digest, m = write_image(store, name, version, state.layers, env=env, workdir=workdir,
                            annotations=ann, spec_digest=state.key, commit=True,
                            replace=replace, created_by="dsec build (Dockerfile)")
    report.items.append(Built(opts.as_ref, "image", digest, "", False, m.size, m.stored_size,
                              spec=str(path)))
    return report
