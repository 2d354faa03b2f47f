"""Image resolution for a sandbox: a store reference materialized into the node's layer
cache (eager), the same reference mounted lazily (docs/lazy.md), or a local rootfs
directory; and what the node's cache holds of an image."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import NotFoundError
from ..core.units import parse_size

log = logging.getLogger(__name__)


@dataclass
class Image:
    ref: str
    digest: str
    lower_dirs: list[Path]
    env: dict[str, str]
    workdir: str
    layer_digests: list[str]  # manifest digests of the layers (empty for a directory image)
    from_store: bool
    lazy_layers: list[dict[str, str]] = field(default_factory=list)  # index, content digest
    annotations: dict[str, str] = field(default_factory=dict)  # the image manifest's


def is_directory_image(image: str) -> bool:
    return image.startswith(("/", "./", "../")) or (Path(image).is_dir() and "@" not in image)


def resolve(store: Any, cache_root: Path, image: str) -> Image:
    """A store reference (``name@version`` or digest), materialized into ``cache_root``, or a
    local rootfs directory."""
    p = Path(image)
    if is_directory_image(image):
        if not p.is_dir():
            raise NotFoundError(f"image directory {image} does not exist")
        return Image(image, "dir:" + str(p.resolve()), [p.resolve()], {}, "/", [], False)
    from ..push.materialize import prepare_image

    prepared = prepare_image(store, image, cache_root)
    return Image(image, prepared.manifest_digest, list(prepared.lower_dirs),
                 dict(prepared.env), prepared.workdir or "/",
                 [d for d, _ in prepared.image.layers], True,
                 annotations=dict(prepared.image.manifest.annotations))


def auto_fetch(store_local: bool) -> tuple[str, str]:
    """The mode ``--fetch auto`` picks for an image not yet in the layer cache, and why.

    From a remote store a lazy mount starts in the time of its indexes while eager waits for
    every byte (docs/benchmarks.md); from a store on a local filesystem eager costs a local
    copy and leaves the sandbox on plain disk, so it is kept."""
    if store_local:
        return "eager", "the store is on a local filesystem"
    from .lazy import available

    why = available()
    if why is not None:
        return "eager", f"lazy mounts are not possible here ({why})"
    return "lazy", "lazy mounts start before the image's bytes arrive from a remote store"


def fetch_report(store_url: str) -> dict[str, str]:
    """What ``--fetch auto`` starts with on this node (for an image not cached yet), why, and
    how lazy mounts are served here (``dsec node check``)."""
    from ..push.stores import open_store
    from .lazy import available, served_by

    mode, why = auto_fetch(bool(getattr(open_store(store_url), "local", False)))
    return {"auto": mode, "why": why,
            "lazy": served_by() if available() is None else "unavailable"}


def fetch_mode(fetch: str, image: str, store: Any = None, cache_root: Path | None = None
               ) -> str:
    """The fetch mode a create really uses: ``auto`` is resolved (an image already in the
    layer cache is eager: nothing to fetch), lazy modes fall back to eager where FUSE is not
    available (and for directory images, which are never fetched)."""
    if fetch == "eager" or is_directory_image(image):
        return "eager"
    if fetch == "auto":
        if store is None or cache_root is None:
            return "eager"
        usage = cache_usage(store, cache_root, image)
        if usage["bytes"] and usage["cached_bytes"] >= usage["bytes"]:
            return "eager"
        return auto_fetch(bool(getattr(store, "local", False)))[0]
    from .lazy import available

    why = available()
    if why is not None:
        log.warning("--fetch %s is not possible here (%s): fetching eagerly", fetch, why)
        return "eager"
    return fetch


def lazy(store: Any, cache_root: Path, sandbox_dir: Path, image: str) -> Image:
    """The image as lazily mounted layers under ``sandbox_dir/lazy/mnt``."""
    from ..push.materialize import LayerCache, resolve_image

    img = resolve_image(store, image)
    mnt = sandbox_dir / "lazy" / "mnt"
    # layers are named by the content digest this node computed, never by a claim
    cache = LayerCache(cache_root)
    return Image(image, img.digest, [mnt / str(n) for n in range(len(img.layers))],
                 dict(img.env), img.workdir or "/", [d for d, _ in img.layers], True,
                 [{"index": m.index or "", "content_digest": cache.verify(store, m, d)[0]}
                  for d, m in img.layers], dict(img.manifest.annotations))


def mount_lazy(sandbox_dir: Path, store_url: str, img: Image, fetch: str,
               cache_root: Path, cache_budget: str, record: float | None) -> None:
    from .lazy import mount_layers

    mount_layers(sandbox_dir / "lazy", store_url, img.lazy_layers,
                 cache=cache_root / "chunks",
                 budget=parse_size(cache_budget, "cache budget"), mode=fetch,
                 record_seconds=record if record is not None else 30.0)


def unmount_lazy(sandbox_dir: Path, cache_root: Path) -> None:
    state = sandbox_dir / "lazy"
    if not state.is_dir():
        return
    from .lazy.mount import cleanup, save_profile

    cleanup(state)
    save_profile(state, cache_root / "profiles", sandbox_dir.name)


def cache_usage(store: Any, cache_root: Path, image: str) -> dict[str, Any]:
    """How many of an image's bytes the node's layer cache already holds."""
    from ..push.materialize import LayerCache, resolve_image

    if is_directory_image(image):
        return {"bytes": 0, "cached_bytes": 0}
    img = resolve_image(store, image)
    cache = LayerCache(cache_root)
    total = sum(m.size for _, m in img.layers)
    cached = sum(m.size for _, m in img.layers if cache.path(m).is_dir())
    return {"bytes": total, "cached_bytes": cached, "digest": img.digest}
