"""What a build reports: one `Built` per spec, in a `BuildReport`. A leaf, so the builder and
the Dockerfile builder it dispatches to both make them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Built:
    ref: str
    kind: str
    manifest: str
    content_digest: str
    cached: bool
    size: int = 0
    stored_size: int = 0
    new_bytes: int = 0
    new_chunks: int = 0
    reused_chunks: int = 0
    seconds: float = 0.0
    spec: str = ""
    replaced: str = ""  # with --replace: the manifest the ref named before this build


@dataclass
class BuildReport:
    store: str
    items: list[Built] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: ``oci:`` references of the specs -> the OCI manifest digest they were imported from
    pinned: dict[str, str] = field(default_factory=dict)
