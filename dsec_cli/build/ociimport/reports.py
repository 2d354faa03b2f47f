"""What an import reports: its progress while it runs, each image imported and its layers,
and the images of a run that failed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...core.errors import DsecError


@dataclass
class ImportProgress:
    """What the transfer commands render: layers done of all, bytes read of all."""

    objects_done: int = 0
    objects_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass
class ImportedLayer:
    ref: str
    manifest: str
    content_digest: str
    diff_id: str
    digest: str  # the blob's digest in the source ("" for a docker save layer)
    size: int
    stored_size: int
    reused: bool
    new_bytes: int = 0


@dataclass
class ImportReport:
    source: str
    ref: str
    manifest: str  # the dsec image manifest digest
    source_digest: str  # the OCI manifest digest the image was read from
    platform: str
    layers: list[ImportedLayer] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ImportRun:
    """What `import_images` did: a report per image imported, the error of each that was
    not (in source order)."""

    reports: list[ImportReport] = field(default_factory=list)
    failed: list[tuple[str, DsecError]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"images": [r.to_dict() for r in self.reports], "seconds": self.seconds,
                "failed": [{"source": s, "error": e.message, "exit_code": e.exit_code}
                           for s, e in self.failed]}
