"""Store pins: while a sandbox runs from a store image, the node writes
``pins/<node>-<sandbox>`` naming the image's manifest, so store gc (push/gc.py reads
``pins/``) keeps everything the sandbox may still read. Pinning is best effort: a read-only
or unreachable store does not stop a sandbox."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

from .state import now

log = logging.getLogger(__name__)


def pin_key(node_id: str, sid: str) -> str:
    return f"pins/{node_id}-{sid}"


def pin(store: Any, node_id: str, state_dir: Path, sid: str, digest: str) -> None:
    doc = {"manifest": digest, "sandbox": sid, "node": socket.gethostname(),
           "state_dir": str(state_dir), "created": now()}
    try:
        store.put(pin_key(node_id, sid), json.dumps(doc).encode())
    except Exception as e:  # the store may be read-only or away: running matters more
        log.warning("could not pin %s for sandbox %s: %s", digest[:12], sid, e)


def unpin(store_fn: Any, node_id: str, sid: str) -> None:
    """``store_fn`` opens the store (only when there is a pin to drop)."""
    try:
        store_fn().delete(pin_key(node_id, sid))
    except Exception as e:
        log.warning("could not release the pin of sandbox %s: %s", sid, e)
