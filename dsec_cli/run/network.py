"""Changing a running sandbox's egress allowlist (network "allowlist"; backends/egress.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import SandboxError

if TYPE_CHECKING:
    from .node import Node


def set_egress(node: Node, sid: str, rules: list[str]) -> dict[str, Any]:
    """Replace what sandbox ``sid`` may reach (an empty list: nothing); returns its egress
    as `describe` reports it."""
    rec = node.lookup(sid)
    if rec.status not in ("running", "paused"):
        raise SandboxError(f"sandbox {rec.id} is {rec.status}: its egress cannot change")
    h = node.handle_of(rec)
    node.backend(rec.backend).set_egress(h, list(rules))
    node.db.update(rec.id, handle=h.state)
    return dict(node.describe(rec.id).get("egress", {}))
