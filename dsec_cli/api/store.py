"""Stores: push, pull, verify and collect garbage by store URL (what `dsec push/pull/verify/gc`
call).

Remote options: ``endpoint_url`` for ``s3://`` (else ``AWS_ENDPOINT_URL``) and ``insecure``
for ``oci://`` registries served over plain HTTP.
"""

from __future__ import annotations

from ..core import validate
from ..push.api import pull, push, store_options
from ..push.gc import GcReport, gc_store
from ..push.stores import check_exists
from ..push.stores.retrying import open_retrying
from ..push.transfer import TransferReport
from ..push.verify import VerifyReport, verify_store

__all__ = ["GcReport", "TransferReport", "VerifyReport", "gc", "gc_store", "pull", "push",
           "verify_store"]


def gc(store: str | None = None, *, grace: float | str = 3600.0, dry_run: bool = False,
       repack_threshold: float = 0.5, endpoint_url: str | None = None,
       insecure: bool = False) -> GcReport:
    """Delete store objects no ref or pin reaches and that stayed unreachable for ``grace``
    (seconds, or "1h"); repack live packs whose dead fraction is above ``repack_threshold``
    (1 = never). Safe while others push."""
    seconds = grace if isinstance(grace, int | float) else validate.duration(grace, "--grace")
    with open_retrying(store, **store_options(endpoint_url, insecure)) as s:
        check_exists(s)
        return gc_store(s, grace=float(seconds), dry_run=dry_run,
                        repack_threshold=repack_threshold, repack=repack_threshold < 1.0)
