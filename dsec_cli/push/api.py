"""The push stage's SDK: push, pull and rmi by store URL (what `dsec push/pull/rmi` call).

Remote options: ``endpoint_url`` for ``s3://`` (else ``AWS_ENDPOINT_URL``) and ``insecure``
for ``oci://`` registries served over plain HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core import validate
from ..core.errors import UsageError
from ..format.refs import delete_ref, get_ref
from .stores import check_exists
from .stores.retrying import open_retrying
from .transfer import DEFAULT_JOBS, ProgressFn, TransferReport, copy_refs


def store_options(endpoint_url: str | None, insecure: bool) -> dict[str, object]:
    """The options `open_store` takes for an S3 endpoint or a plain-HTTP registry."""
    opts: dict[str, object] = {}
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    if insecure:
        opts["insecure"] = True
    return opts


def _check(refs: Sequence[str], jobs: int = DEFAULT_JOBS) -> None:
    """Every argument checked before any store is opened."""
    if not refs:
        raise UsageError("name at least one NAME@VERSION")
    for r in refs:
        validate.ref(r)
    validate.positive_int(jobs, "--jobs")


def push(refs: Sequence[str], to: str, *, store: str | None = None, jobs: int = DEFAULT_JOBS,
         endpoint_url: str | None = None, insecure: bool = False,
         progress: ProgressFn | None = None, replace: bool = False) -> TransferReport:
    """Copy refs from the local store (default: the configured one) to the store at `to`.
    A ref `to` holds with other content is refused (`RefConflictError`) unless ``replace``."""
    _check(refs, jobs)
    remote = store_options(endpoint_url, insecure)
    with open_retrying(store) as src, open_retrying(to, **remote) as dst:
        check_exists(src)
        return copy_refs(src, dst, refs, jobs=jobs, progress=progress, replace=replace)


def pull(refs: Sequence[str], frm: str, *, store: str | None = None, jobs: int = DEFAULT_JOBS,
         endpoint_url: str | None = None, insecure: bool = False,
         progress: ProgressFn | None = None, replace: bool = False) -> TransferReport:
    """Copy refs from the store at `frm` into the local store (same rule as `push`)."""
    _check(refs, jobs)
    with open_retrying(frm, **store_options(endpoint_url, insecure)) as src, \
            open_retrying(store) as dst:
        check_exists(src)
        return copy_refs(src, dst, refs, jobs=jobs, progress=progress, replace=replace)


@dataclass
class Removed:
    ref: str
    manifest: str


def rmi(refs: Sequence[str], *, store: str | None = None, endpoint_url: str | None = None,
        insecure: bool = False) -> list[Removed]:
    """Delete refs; the objects only they reached are freed by the next `dsec gc`.

    Every ref is checked first, so a typo removes nothing."""
    _check(refs)
    with open_retrying(store, **store_options(endpoint_url, insecure)) as s:
        check_exists(s)
        found = [Removed(r, get_ref(s, r).manifest) for r in dict.fromkeys(refs)]
        for r in found:
            delete_ref(s, r.ref)
        return found
