"""Images: manifests that stack existing layers without rebuilding them."""

from __future__ import annotations

from ..core.errors import SpecError
from ..format.manifest import Manifest, load_manifest, put_manifest
from ..format.refs import commit_ref
from ..format.validate import layer_count_problem
from ..push.stores.base import Store


def base_warnings(layers: list[str], manifests: list[Manifest]) -> list[str]:
    """A layer built by `run` steps over some base, stacked without that base below it, is
    allowed (the user may know better) but worth a warning."""
    out = []
    for n, lm in enumerate(manifests):
        missing = set(lm.base) - set(layers[:n])
        if missing:
            out.append(f"{lm.ref} was built on {', '.join(m[:12] for m in sorted(missing))}, "
                       "which this image does not stack below it")
    return out


def write_image(st: Store, name: str, version: str, layers: list[str], *,
                env: dict[str, str] | None = None, workdir: str = "", spec_digest: str = "",
                manifests: list[Manifest] | None = None, commit: bool = False,
                replace: bool = False, created_by: str = "dsec build",
                annotations: dict[str, str] | None = None
                ) -> tuple[str, Manifest]:
    """Put an image manifest stacking ``layers`` (manifest digests, bottom first); with
    ``commit``, point ``name@version`` at it under `refs.commit_ref`'s rule."""
    problem = layer_count_problem(len(layers))
    if problem:
        raise SpecError(f"image {name}@{version}: {problem}")
    ms = manifests or [load_manifest(st, d) for d in layers]
    for d, lm in zip(layers, ms, strict=True):
        if lm.kind != "layer":
            raise SpecError(f"{lm.ref} ({d[:12]}) is not a layer")
    m = Manifest(kind="image", name=name, version=version, layers=list(layers),
                 env=env or {}, workdir=workdir, spec_digest=spec_digest,
                 size=sum(x.size for x in ms), stored_size=sum(x.stored_size for x in ms),
                 files=sum(x.files for x in ms), created_by=created_by,
                 annotations=dict(annotations or {}))
    digest = put_manifest(st, m)
    if commit:
        commit_ref(st, name, version, digest, replace=replace, verb=f"this {created_by} made")
    return digest, m
