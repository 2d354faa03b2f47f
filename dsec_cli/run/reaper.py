"""The node's own TTL reaper: a sandbox created with ``--ttl`` is removed within seconds of
its expiry, with no cron and no `dsec gc`.

One reaper process per node state directory, started by the create that makes the first
sandbox with a TTL (`ensure`) and holding ``<state>/reaper.lock`` while it lives. It wakes
at the next expiry (and at least every `POLL` seconds, so a sandbox created meanwhile with
an earlier one is seen), removes what expired, and exits once no sandbox has a TTL.

The handover is race-free without a second lock: a creator commits its row *before* it
tries the lock, and the reaper, about to exit, releases the lock *before* its last look at
the rows. Either that look sees the new row (and the reaper goes on), or the row was
committed after the release, and the creator then finds the lock free and starts a reaper.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from ..core.errors import DsecError, NotFoundError
from .lifecycle import NodeCore
from .state import now

log = logging.getLogger(__name__)

#: the longest the reaper sleeps between looks at the rows (seconds)
POLL = 2.0
LOCK = "reaper.lock"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding dsec_cli


def _try_lock(root: Path) -> int | None:
    """The reaper lock's fd, held, or None where a reaper holds it."""
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def ensure(node: NodeCore) -> None:
    """Make sure a reaper runs for this node (called after a row with a TTL is committed)."""
    fd = _try_lock(node.root)
    if fd is None:
        return  # one runs, and will see the new row
    os.close(fd)  # the reaper takes it; two creators racing here start two, one stays
    code = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
            "from dsec_cli.run.reaper import serve; serve(sys.argv[1], sys.argv[2])")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(node.root / "reaper.log", flags, 0o600), "ab") as out:
        subprocess.Popen([sys.executable, "-c", code, str(node.root), node.store_url],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                         start_new_session=True, close_fds=True)  # outlives the creator


def reap(node: NodeCore, t: float | None = None) -> tuple[list[str], float | None]:
    """Remove the sandboxes expired at ``t`` (default: now); returns their ids and the
    next expiry among those left (None: no sandbox has a TTL)."""
    t = now() if t is None else t
    removed, nxt = [], None
    for r in node.db.all():
        if r.expires is None:
            continue
        if r.expires > t:
            nxt = r.expires if nxt is None else min(nxt, r.expires)
            continue
        try:
            node.remove(r.id)
            removed.append(r.id)
        except NotFoundError:
            pass  # removed meanwhile
        except DsecError as e:  # tried again at the next look
            log.warning("expired sandbox %s not removed yet: %s", r.id, e.message)
            nxt = t + POLL
    return removed, nxt


def serve(state_dir: str, store: str) -> None:
    """The reaper's loop (its own process, see the module's docstring): it removes, so the
    node's lifecycle core is all it needs."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reaper: %(message)s")
    root = Path(state_dir)
    held = _try_lock(root)
    if held is None:
        return
    node = NodeCore(state_dir, store)
    try:
        while held is not None:
            removed, nxt = reap(node)
            for sid in removed:
                log.info("removed %s: its TTL ran out", sid)
            if nxt is not None:
                time.sleep(max(0.05, min(POLL, nxt - time.time())))
                continue
            os.close(held)  # released before the last look (see the docstring)
            held = None
            if reap(node)[1] is not None:
                held = _try_lock(root)  # None: a reaper a creator started took over
    finally:
        if held is not None:
            os.close(held)
