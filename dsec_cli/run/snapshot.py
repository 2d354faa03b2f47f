"""Snapshots: a sandbox's writable diff becomes a new layer and an image stacking it on the
sandbox's own layers, optionally pushed to another store (`dsec snapshot --as --push`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import UsageError

if TYPE_CHECKING:
    from .node import Node


def snapshot(node: Node, sid: str, ref: str, push: str | None = None, *,
             replace: bool = False) -> dict[str, Any]:
    """The sandbox's writable diff becomes layer ``NAME-layer@VERSION`` and image
    ``NAME@VERSION`` (the original's layers plus the new one). Versions are immutable
    (`refs.check_ref`): either ref already in the store, or in ``push``'s, is refused before
    the sandbox is paused, unless ``replace``."""
    from ..core.digests import parse_ref

    name, version = _parse_ref(ref, parse_ref)
    rec = node.lookup(sid)
    if not rec.spec.get("from_store"):
        raise UsageError(f"sandbox {rec.id} runs a directory image: only sandboxes of store "
                         "images can be snapshotted")
    from ..format.refs import check_ref

    st = node.store()
    refs = [f"{name}-layer@{version}", f"{name}@{version}"]
    for r in refs:
        check_ref(st, r, "", replace=replace, verb="a snapshot does not move it")
    if push:
        _check_push(refs, push, replace)
    b, h = node.backend(rec.backend), node.handle_of(rec)
    was_running = rec.status == "running" and b.is_alive(h)
    if was_running:
        b.pause(h)  # a consistent diff: nothing writes while it is read
    try:
        upper = b.snapshot_diff(h)
        from ..build.image import write_image
        from ..build.layer import build_layer_from_dir
        from ..format.tree import ScanReport

        base = list(rec.spec.get("layer_digests", []))
        scan_report = ScanReport()
        layer_digest, _ = build_layer_from_dir(
            st, upper, f"{name}-layer", version, base=base,
            created_by=f"dsec snapshot {rec.id}", snapshot=scan_report, replace=replace)
        image_digest, _ = write_image(
            st, name, version, [*base, layer_digest], env=rec.spec.get("env", {}),
            workdir=rec.spec.get("workdir", ""), commit=True, replace=replace,
            created_by=f"dsec snapshot {rec.id}")
    finally:
        if was_running:
            b.resume(h)
    out: dict[str, Any] = {"sandbox": rec.id, "image": f"{name}@{version}",
                           "image_digest": image_digest, "layer": f"{name}-layer@{version}",
                           "layer_digest": layer_digest,
                           "warnings": scan_report.warnings()}
    if push:
        out["pushed"] = _push(st, refs, push, replace)
    return out


def _parse_ref(ref: str, parse_ref: Any) -> tuple[str, str]:
    try:
        name, version = parse_ref(ref)
    except Exception as e:
        raise UsageError(f"invalid snapshot name {ref!r}: expected NAME@VERSION ({e})") from e
    return name, version


def _check_push(refs: list[str], url: str, replace: bool) -> None:
    from ..format.refs import check_ref
    from ..push.stores.retrying import open_retrying

    with open_retrying(url) as dst:
        for r in refs:
            check_ref(dst, r, "", replace=replace, verb="a snapshot does not move it")


def _push(store: Any, refs: list[str], url: str, replace: bool) -> Any:
    """Copy a snapshot's refs to another store (what `dsec snapshot --push URL` does)."""
    from ..push.stores.retrying import open_retrying
    from ..push.transfer import copy_refs

    with open_retrying(url) as dst:
        report = copy_refs(store, dst, refs, replace=replace)
    return report.to_dict()
