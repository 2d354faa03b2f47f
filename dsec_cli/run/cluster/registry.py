"""Nodes in the user's config (``nodes:`` in ~/.config/dsec/config.yaml): add, remove, check,
list. Every input is validated before anything is written, and `add` talks to the node first
(unless told not to), so a node that cannot be reached or whose host key is wrong is never
saved.

    nodes:
      node1: {address: root@10.0.0.1:22, identity: ~/.ssh/id_ed25519,
              known_hosts: ~/.ssh/known_hosts, dsec: dsec, labels: {gpu: "0"}}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ...core.config import load_config, save_user_config, user_config_file
from ...core.errors import ConfigError, NotFoundError, UsageError
from .remote import NodeEntry, RemoteNode, drop_channel
from .ssh import SshTarget, parse_address

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
RESERVED = {"local", "auto"}


def check_name(name: str) -> str:
    if not _NAME.match(name) or name in RESERVED:
        raise UsageError(f"invalid node name {name!r}: letters, digits, '-', '_', '.' "
                         f"(at most 63, not 'local' or 'auto')")
    return name


def parse_labels(text: str | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        k, sep, v = item.strip().partition("=")
        if not sep or not k:
            raise UsageError(f"invalid label {item!r}: expected KEY=VALUE")
        labels[k] = v
    return labels


def _entry(name: str, doc: Any, where: str) -> NodeEntry:
    if not isinstance(doc, dict) or not isinstance(doc.get("address"), str):
        raise ConfigError(f"{where}: nodes.{name} needs an address (USER@HOST[:PORT])")
    try:
        addr = parse_address(doc["address"])
    except UsageError as e:
        raise ConfigError(f"{where}: nodes.{name}: {e.message}") from e
    return NodeEntry(name, SshTarget(addr, doc.get("identity"), doc.get("known_hosts")),
                     str(doc.get("dsec") or "dsec"),
                     {str(k): str(v) for k, v in (doc.get("labels") or {}).items()})


def load_nodes() -> dict[str, NodeEntry]:
    cfg = load_config()
    where = cfg.sources.get("nodes", str(user_config_file()))
    return {name: _entry(name, doc, where) for name, doc in sorted(cfg.nodes.items())}


def get_entry(name: str) -> NodeEntry:
    nodes = load_nodes()
    if name not in nodes:
        known = ", ".join(nodes) or "none"
        raise NotFoundError(f"unknown node {name!r} (configured: {known})",
                            hint="add it with `dsec node add NAME USER@HOST[:PORT]`")
    return nodes[name]


def get_node(name: str) -> RemoteNode:
    return RemoteNode(get_entry(name))


def _doc(entry: NodeEntry) -> dict[str, Any]:
    t = entry.target
    doc: dict[str, Any] = {"address": str(t.address), "dsec": entry.dsec}
    if t.identity:
        doc["identity"] = t.identity
    if t.known_hosts:
        doc["known_hosts"] = t.known_hosts
    if entry.labels:
        doc["labels"] = dict(entry.labels)
    return doc


def _file(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    p = Path(os.path.expanduser(path)).absolute()
    if not p.is_file():
        raise NotFoundError(f"{what} {path} does not exist")
    return str(p)


def add_node(name: str, address: str, *, identity: str | None = None,
             known_hosts: str | None = None, labels: str | None = None, dsec: str = "dsec",
             bootstrap: bool = False, check: bool = True,
             install_dir: str | None = None) -> dict[str, Any]:
    """Validate, reach the node (optionally installing dsec there first), then save it."""
    check_name(name)
    entry = NodeEntry(name, SshTarget(parse_address(address), _file(identity, "identity key"),
                                      _file(known_hosts, "known_hosts file")),
                      dsec, parse_labels(labels))
    cfg = load_config()
    if name in cfg.nodes:
        raise UsageError(f"node {name!r} already exists", hint=f"dsec node rm {name} first")
    info: dict[str, Any] = {}
    if bootstrap:
        from .bootstrap import DEFAULT_DIR
        from .bootstrap import bootstrap as _bootstrap

        entry = _bootstrap(entry, install_dir or DEFAULT_DIR)
    if check or bootstrap:
        info = RemoteNode(entry).info()
    nodes = dict(cfg.nodes)
    nodes[name] = _doc(entry)
    path = save_user_config({"nodes": nodes})
    return {"name": name, **_doc(entry), "config": str(path), "info": info}


def remove_node(name: str) -> dict[str, Any]:
    entry = get_entry(name)
    cfg = load_config()
    nodes = {k: v for k, v in cfg.nodes.items() if k != name}
    drop_channel(entry)
    entry.target.close_master()
    save_user_config({"nodes": nodes})
    return {"name": name, "removed": True}
