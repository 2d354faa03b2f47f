"""Scoring in a fork: an agent's sandbox graded by hidden tests it never sees.

The agent's writable diff is read on the host while the sandbox is paused; a scoring sandbox
(the fork) starts from the grader image (the task image's layers, then the layer with the
hidden tests), takes only the agent's changes on the task's patch surface, and runs the
grader's command with its own limits, its own environment and no network. The result (one
outcome per test, the reward, the log, the tamper audit of protected paths) is returned and
appended to the node's grading journal; a job's sandbox has it journaled with its rollout's
trajectory too (run/jobs/). The fork is removed whatever happens; a grading
process killed midway leaves a marker that `reconcile_grading` (run before every grade)
acts on, and the fork's TTL bounds it in any case.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

from ..backends import _rootfs
from ..core.errors import DsecError, UsageError
from .options import CreateOptions
from .surface import (
    PROTECTED_ALWAYS,
    Patterns,
    StartState,
    audit,
    read_diff,
    record_start,
    split_surface,
)

if TYPE_CHECKING:
    from .node import Node
    from .state import SandboxRecord

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 600.0
#: the fork lives at most this long past the grader's timeout, even if nothing removes it
FORK_TTL_MARGIN = 300.0
MAX_RESULTS = 8 << 20
MAX_LOG = 1 << 20
START_FILE = "task-start.json"
#: set in every fork: no bytecode written, no pytest plugins loaded from entry points, no
#: user site directory
FORK_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "PYTHONNOUSERSITE": "1"}


@dataclass
class TestOutcome:
    name: str
    outcome: str  # passed | failed | error | skipped | missing
    message: str = ""


@dataclass
class GradeResult:
    sandbox: str
    grader: str
    reward: float
    passed: bool  # every test passed
    tests: list[TestOutcome]
    exit_code: int | None
    timed_out: bool
    tampered: bool  # protected paths changed, created or deleted: the trainer may mask
    tamper: dict[str, list[str]]
    applied: list[str]  # surface paths taken from the agent (deletions as "-path")
    dropped: list[dict[str, str]]  # changes left behind, with why
    log: str
    infra_error: str = ""  # the grading itself failed (not the agent): no reward to trust
    duration: float = 0.0
    fork: str = ""
    finished: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- what the images declare -------------------------------------------------------------------
def _annotation(manifest: Any, key: str, what: str) -> dict[str, Any]:
    text = manifest.annotations.get(key)
    if text is None:
        return {}
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise UsageError(f"{what}: the {key} annotation is not a JSON object")
    return doc


def task_of(node: Node, rec: SandboxRecord) -> dict[str, Any]:
    """The `task:` section of the image a sandbox runs: its patch surface and protected paths."""
    from ..format.manifest import load_manifest

    if not rec.spec.get("from_store"):
        raise UsageError(f"sandbox {rec.id} runs a directory image: only sandboxes of store "
                         "images (with a `task:` section) can be graded")
    m = load_manifest(node.store(), rec.image_digest)
    task = _annotation(m, "dsec.task", m.ref)
    if not isinstance(task.get("patch"), list) or not task["patch"]:
        raise UsageError(f"image {m.ref} declares no task: its spec needs a `task:` section "
                         "with `patch:` (the paths an agent's patch may change)")
    return task


def _protected(task: dict[str, Any], workdir: str) -> Patterns:
    return Patterns([*PROTECTED_ALWAYS, *task.get("protected", [])], workdir)


def _lowers(rec: SandboxRecord) -> list[Path]:
    return [Path(p) for p in rec.layers]


# -- task start --------------------------------------------------------------------------------
def start_task(node: Node, sid: str) -> dict[str, Any]:
    """Record the digests of the protected paths now (after any setup, before the agent
    acts), on the host beside the sandbox, where nothing inside reaches; grading compares
    against it. Without it, grading compares against the image."""
    rec = node.lookup(sid)
    task = task_of(node, rec)
    protected = _protected(task, rec.spec.get("workdir") or "/")
    with _paused(node, rec) as upper:
        diff = read_diff(upper, want=Patterns([]), hashed=protected)
    manifest = record_start(_lowers(rec), diff, protected)
    path = node.sandboxes_dir / rec.id / START_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    os.replace(tmp, path)
    return {"sandbox": rec.id, "protected": len(manifest), "path": str(path)}


def _start_state(node: Node, rec: SandboxRecord) -> StartState:
    path = node.sandboxes_dir / rec.id / START_FILE
    recorded = None
    if path.is_file():
        doc = json.loads(path.read_text())
        recorded = {str(k): str(v) for k, v in doc.items()}
    return StartState(_lowers(rec), recorded)


class _paused:
    """The sandbox's writable diff, with the sandbox paused (nothing writes while it is
    read) and resumed afterwards."""

    def __init__(self, node: Node, rec: SandboxRecord, marker: Path | None = None) -> None:
        self.node, self.rec, self.marker = node, rec, marker
        self.b = node.backend(rec.backend)
        self.h = node.handle_of(rec)
        self.was_running = False

    def __enter__(self) -> Path:
        if not self.b.supports_snapshot:
            raise UsageError(f"{self.rec.backend} sandboxes keep no writable diff to grade: "
                             "use the container backend for graded tasks")
        self.was_running = self.rec.status == "running" and self.b.is_alive(self.h)
        if self.was_running:
            if self.marker is not None:
                _update_marker(self.marker, paused=self.rec.id)
            self.b.pause(self.h)
        return self.b.snapshot_diff(self.h)

    def __exit__(self, *exc: Any) -> None:
        if self.was_running:
            self.b.resume(self.h)
            if self.marker is not None:
                _update_marker(self.marker, paused="")


# -- markers: a grade killed midway ------------------------------------------------------------
def _grading_dir(node: Node) -> Path:
    d = node.root / "grading"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _update_marker(marker: Path, **fields: str) -> None:
    doc = json.loads(marker.read_text())
    doc.update(fields)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, marker)


def reconcile_grading(node: Node) -> list[str]:
    """Remove the forks of grading processes that died, and resume the agent sandboxes they
    left paused; returns the forks removed."""
    removed = []
    for marker in sorted(_grading_dir(node).glob("*.json")):
        try:
            doc = json.loads(marker.read_text())
        except (OSError, ValueError):
            marker.unlink(missing_ok=True)
            continue
        if _rootfs.alive(doc.get("pid", 0), doc.get("start")):
            continue
        if doc.get("fork"):
            try:
                node.remove(doc["fork"])
                removed.append(doc["fork"])
            except DsecError as e:
                log.info("fork %s of a dead grade: %s", doc["fork"], e)
        if doc.get("paused"):
            try:
                rec = node.lookup(doc["paused"])
                node.backend(rec.backend).resume(node.handle_of(rec))
            except DsecError as e:
                log.info("agent sandbox %s left paused by a dead grade: %s", doc["paused"], e)
        marker.unlink(missing_ok=True)
    return removed


# -- results -----------------------------------------------------------------------------------
_DOCTYPE = re.compile(rb"<!(DOCTYPE|ENTITY)", re.I)


def parse_junit(data: bytes) -> list[TestOutcome]:
    """Test outcomes from a JUnit XML report (pytest's `--junitxml`, most runners'). The
    file comes from a sandbox where the agent's code ran: entity declarations are refused."""
    if _DOCTYPE.search(data):
        raise ValueError("the results file declares a DOCTYPE or entities")
    root = ElementTree.fromstring(data)
    out = []
    for case in root.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        full = f"{cls}::{name}" if cls else name
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
                break
        out.append(TestOutcome(full, outcome, message))
    return out


def _select(found: list[TestOutcome], required: list[str]) -> list[TestOutcome]:
    """The required tests' outcomes: a test reported twice counts only if every report
    passed; a required test not reported is missing."""
    if not required:
        return found
    by_name: dict[str, list[TestOutcome]] = {}
    for t in found:
        by_name.setdefault(t.name, []).append(t)
        short = t.name.rsplit("::", 1)[-1]
        if short != t.name:
            by_name.setdefault(short, []).append(t)
    out = []
    for name in required:
        reports = by_name.get(name, [])
        if not reports:
            out.append(TestOutcome(name, "missing"))
        else:
            bad = next((r for r in reports if r.outcome != "passed"), None)
            out.append(TestOutcome(name, bad.outcome if bad else "passed",
                                   bad.message if bad else ""))
    return out


def _reward(tests: list[TestOutcome], policy: str) -> float:
    if not tests:
        return 0.0
    ok = sum(t.outcome == "passed" for t in tests)
    if policy == "fraction":
        return ok / len(tests)
    return 1.0 if ok == len(tests) else 0.0


# -- grading -----------------------------------------------------------------------------------
def grader_of(node: Node, grader: str, rec: SandboxRecord) -> dict[str, Any]:
    """The grader image's `grade:` section, after checking it stacks the task image's layers
    first (the fork starts from the task image)."""
    from ..push.materialize import resolve_image

    img = resolve_image(node.store(), grader)
    spec = _annotation(img.manifest, "dsec.grade", grader)
    if not spec.get("command"):
        raise UsageError(f"{grader} is not a grader image: its spec needs a `grade:` section "
                         "with `command:`")
    task_layers = list(rec.spec.get("layer_digests", []))
    grader_layers = [d for d, _ in img.layers]
    if grader_layers[:len(task_layers)] != task_layers:
        raise UsageError(f"grader {grader} does not start from the task image of sandbox "
                         f"{rec.id} ({rec.image}): its layers must begin with the task's",
                         hint="list the task image's layers first in the grader image spec")
    return spec


def _apply(node: Node, fork: str, taken: list[Any]) -> list[str]:
    applied = []
    for c in taken:
        path = "/" + c.path
        if c.kind == "reg":
            node.put_file(fork, path, c.data or b"", c.mode, user="root")
            applied.append(c.path)
        else:
            r = node.exec(fork, ["/bin/sh", "-c", 'rm -rf -- "$1"', "sh", path], timeout=60)
            if r.exit_code != 0:
                raise DsecError(f"cannot delete {path} in the scoring fork: "
                                f"{r.stderr.decode('utf-8', 'replace')[:500]}")
            applied.append("-" + c.path)
    return applied


def grade(node: Node, sid: str, grader: str, *, backend: str = "container",
          timeout: float | None = None, journal: bool = True) -> GradeResult:
    """Score sandbox ``sid`` with grader image ``grader`` in a fork (see the module doc)."""
    started = time.monotonic()
    reconcile_grading(node)
    rec = node.lookup(sid)
    task = task_of(node, rec)
    spec = grader_of(node, grader, rec)
    workdir = rec.spec.get("workdir") or "/"
    surface = Patterns(task["patch"], workdir)
    protected = _protected(task, workdir)
    limit = float(timeout or spec.get("timeout") or DEFAULT_TIMEOUT)

    marker = _grading_dir(node) / f"{secrets.token_hex(8)}.json"
    marker.write_text(json.dumps({"pid": os.getpid(),
                                  "start": _rootfs.proc_start_time(os.getpid()),
                                  "agent": rec.id, "fork": "", "paused": ""}))
    fork, keep_marker = "", False
    try:
        with _paused(node, rec, marker) as upper:
            diff = read_diff(upper, want=surface, hashed=protected)
        tamper = audit(_start_state(node, rec), diff, protected)
        taken, dropped = split_surface(diff, surface)
        opts = CreateOptions(backend=backend, cpus=spec.get("cpus"), memory=spec.get("memory"),
                             pids=spec.get("pids"), ttl=limit + FORK_TTL_MARGIN,
                             network="none", env={**FORK_ENV, **spec.get("env", {})},
                             workdir=workdir)
        fork_rec = node.create(grader, opts)
        fork = fork_rec.id
        _update_marker(marker, fork=fork)
        applied = _apply(node, fork, taken)
        r = node.exec(fork, ["/bin/sh", "-c", spec["command"]], cwd=workdir, timeout=limit,
                      capture_limit=MAX_LOG)
        out = (r.stdout + r.stderr).decode("utf-8", "replace")[-MAX_LOG:]
        tests = _results(node, fork, spec, r.exit_code, r.timed_out)
        passed = bool(tests) and all(t.outcome == "passed" for t in tests) \
            and r.exit_code == 0 and not r.timed_out
        policy = spec.get("reward", "all")
        result = GradeResult(
            sandbox=rec.id, grader=grader,
            reward=_reward(tests, policy) if passed or policy == "fraction" else 0.0,
            passed=passed, tests=tests,
            exit_code=r.exit_code, timed_out=r.timed_out,
            tampered=any(tamper.values()), tamper=tamper, applied=applied, dropped=dropped,
            log=out, fork=fork)
        if r.timed_out:
            result.reward, result.passed = 0.0, False
    except UsageError:
        raise
    except DsecError as e:
        result = GradeResult(rec.id, grader, 0.0, False, [], None, False, False,
                             {"changed": [], "created": [], "deleted": []}, [], [], "",
                             infra_error=e.message, fork=fork)
    finally:
        if fork:
            try:
                node.remove(fork)
            except DsecError as e:  # left to reconcile (marker kept) and the fork's TTL
                log.warning("cannot remove scoring fork %s: %s", fork, e)
                keep_marker = True  # for reconcile_grading; the fork's TTL bounds it too
        if not keep_marker:
            marker.unlink(missing_ok=True)
    result.duration = time.monotonic() - started
    if journal:
        with open(_grading_dir(node) / "journal.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in result.to_dict().items() if k != "log"},
                               sort_keys=True) + "\n")
        _journal_with_rollout(node, result)
    return result


def _journal_with_rollout(node: Node, result: GradeResult) -> None:
    """A sandbox owned by a job: the grade joins its rollout's trajectory (jobs.db)."""
    if not (node.root / "jobs.db").exists():  # no job was ever started here
        return
    from .jobs import node_jobs

    node_jobs(node).record_grade(result.sandbox, result.to_dict())


def _results(node: Node, fork: str, spec: dict[str, Any], exit_code: int,
             timed_out: bool) -> list[TestOutcome]:
    required = list(spec.get("tests", []))
    if not spec.get("results"):
        ok = exit_code == 0 and not timed_out
        return [TestOutcome("command", "passed" if ok else "failed")]
    r = node.exec(fork, ["/bin/sh", "-c", 'test -f "$1" && head -c $2 -- "$1"', "sh",
                         spec["results"], str(MAX_RESULTS + 1)], timeout=60,
                  capture_limit=MAX_RESULTS + 1)
    if r.exit_code != 0 or not r.stdout or len(r.stdout) > MAX_RESULTS:
        return _select([], required) or [TestOutcome("results", "missing",
                                                     f"no results at {spec['results']}")]
    try:
        found = parse_junit(r.stdout)
    except (ValueError, ElementTree.ParseError) as e:
        return _select([], required) or [TestOutcome("results", "error", str(e)[:500])]
    return _select(found, required)
