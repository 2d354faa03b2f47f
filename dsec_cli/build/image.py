"""Images: manifests that stack existing layers without rebuilding them."""

from __future__ import annotations

import logging

from ..core.errors import SpecError
from ..format.manifest import Manifest, load_manifest, put_manifest
from ..format.refs import set_ref
from ..push.stores.base import Store

log = logging.getLogger(__name__)


def write_image(st: Store, name: str, version: str, layers: list[str], *,
                env: dict[str, str] | None = None, workdir: str = "", spec_digest: str = "",
                manifests: list[Manifest] | None = None, set_ref_too: bool = False,
                created_by: str = "dsec build") -> tuple[str, Manifest]:
    """Put an image manifest stacking ``layers`` (manifest digests, bottom first)."""
    ms = manifests or [load_manifest(st, d) for d in layers]
    for d, lm in zip(layers, ms, strict=True):
        if lm.kind != "layer":
            raise SpecError(f"{lm.ref} ({d[:12]}) is not a layer")
        missing = set(lm.base) - set(layers[: layers.index(d)])
        if missing:
            log.warning("%s was built on %s, which this image does not stack below it",
                        lm.ref, ", ".join(m[:12] for m in sorted(missing)))
    m = Manifest(kind="image", name=name, version=version, layers=list(layers),
                 env=env or {}, workdir=workdir, spec_digest=spec_digest,
                 size=sum(x.size for x in ms), stored_size=sum(x.stored_size for x in ms),
                 files=sum(x.files for x in ms), created_by=created_by)
    digest = put_manifest(st, m)
    if set_ref_too:
        set_ref(st, name, version, digest)
    return digest, m
