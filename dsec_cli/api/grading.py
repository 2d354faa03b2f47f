"""The grader plane: clean task images (git history scrubbed and checked) and scoring a
sandbox in a fork with hidden tests (docs/grader.md).

    import dsec_cli.api.grading as grading
    grading.git_scrub_layer("repo@1", "/testbed", base="v1.0", as_ref="repo@1-clean")
    result = grading.grade(sandbox_id, "task1-grader@1")   # GradeResult: reward, tests, tamper
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..build.gitscrub import GitCheck, check, scrub
from ..core import validate
from ..core.config import load_config
from ..core.digests import parse_ref
from ..core.errors import UsageError
from ..format.refs import resolve
from ..push.stores.base import Store
from ..run.grade import GradeResult
from ..run.grade import grade as _grade
from ..run.grade import start_task as _start
from ..run.node import Node
from .images import _store
from .routing import target

__all__ = ["GitCheck", "GradeResult", "git_scrub_layer", "git_check", "grade", "start_task"]


def _scratch(st: Store) -> Path:
    tmp = Path(load_config().data_dir) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="git-", dir=tmp))


def git_scrub_layer(ref: str, path: str, *, base: str = "HEAD", as_ref: str,
                    store: str | Store | None = None) -> dict[str, Any]:
    """A new layer ``as_ref``: the layer (or image) ``ref`` with the git repository at
    ``path`` reduced to one commit holding ``base``'s tree. The original is left as it is."""
    from ..build.layer import build_layer_from_dir
    from ..push.materialize import export

    try:
        name, version = parse_ref(as_ref)
    except UsageError as e:
        raise UsageError(f"invalid --as {as_ref!r}: {e.message}") from None
    st = _store(store)
    work = _scratch(st)
    try:
        tree = work / "tree"
        img = export(st, ref, tree)
        scrub(tree, path, base)
        digest, m = build_layer_from_dir(
            st, tree, name, version, base=list(img.manifest.base), env=img.env,
            workdir=img.workdir if img.workdir != "/" else "",
            created_by=f"dsec git-scrub {ref} {path}")
        return {"ref": as_ref, "digest": digest, "from": ref, "from_digest": resolve(st, ref),
                "path": path, "base": base, "size": m.size,
                "size_before": sum(x.size for _, x in img.layers), "files": m.files}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def git_check(ref: str, path: str, store: str | Store | None = None) -> GitCheck:
    """Every way the repository at ``path`` in ``ref`` reaches past one parentless commit
    (other commits, refs, reflogs, remotes, objects nothing reachable names)."""
    from ..push.materialize import export

    st = _store(store)
    work = _scratch(st)
    try:
        export(st, ref, work / "tree")
        return check(work / "tree", path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _node(sandbox_id: str, state_dir: str | Path | None) -> Any:
    """This node, or the cluster node (a `RemoteNode`) a ``NODE/ID`` sandbox is on."""
    return target(sandbox_id, None, state_dir)


def grade(sandbox_id: str, grader: str, *, timeout: float | str | None = None,
          backend: str = "container", state_dir: str | Path | None = None) -> GradeResult:
    """Score a sandbox in a fork started from the grader image ``grader`` (the task image's
    layers and the hidden tests): only the agent's changes on the task's patch surface are
    taken; the grader's command runs with its own limits and no network. The fork is
    removed whatever happens. A cluster sandbox (``NODE/ID``) is graded on its node."""

    validate.image(grader, "--grader")
    secs = None if timeout is None else float(timeout) if isinstance(timeout, int | float) \
        else validate.duration(timeout, "--timeout")
    node = _node(sandbox_id, state_dir)
    if not isinstance(node, Node):
        return node.grade(sandbox_id, grader, backend=backend, timeout=secs)  # type: ignore
    return _grade(node, sandbox_id, grader, backend=backend, timeout=secs)


def start_task(sandbox_id: str, state_dir: str | Path | None = None) -> dict[str, Any]:
    """Record the protected paths' digests now: grading reports what changed since."""

    node = _node(sandbox_id, state_dir)
    if not isinstance(node, Node):
        return node.start_task(sandbox_id)  # type: ignore[attr-defined]
    return _start(node, sandbox_id)

