"""`dsec cp`: files between the host and a sandbox (one side is ``SANDBOX:PATH``).

The sandbox side goes through the agent, which resolves the path inside the sandbox's own
root, so no path argument can reach the host's files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..core.errors import NotFoundError, UsageError
from .node import Node


def _split(arg: str) -> tuple[str | None, str]:
    head, sep, tail = arg.partition(":")
    if sep and head and "/" not in head and tail:
        return head, tail
    return None, arg


def copy(node: Node, src: str, dst: str) -> dict[str, Any]:
    s_id, s_path = _split(src)
    d_id, d_path = _split(dst)
    if (s_id is None) == (d_id is None):
        raise UsageError("exactly one side of cp must be SANDBOX:PATH, e.g. "
                         "`dsec cp ./f.txt 1a2b3c:/tmp/f.txt`")
    if d_id is not None:  # host -> sandbox
        host = Path(s_path)
        if not host.is_file():
            raise NotFoundError(f"no such file on the host: {host}")
        target = d_path + host.name if d_path.endswith("/") else d_path
        data = host.read_bytes()
        node.put_file(d_id, target, data, host.stat().st_mode & 0o7777)
        return {"sandbox": node.lookup(d_id).id, "to": target, "bytes": len(data)}
    assert s_id is not None
    data, mode = node.get_file_with_mode(s_id, s_path)
    host = Path(d_path)
    if host.is_dir():
        host = host / Path(s_path).name
    tmp = host.with_name(f".{host.name}.dsec-tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, host)
    return {"sandbox": node.lookup(s_id).id, "from": s_path, "to": str(host), "bytes": len(data)}
