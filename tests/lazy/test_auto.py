"""`--fetch auto` (the default): lazy from a remote store where lazy mounts work, eager from a
local store or for an image already in the layer cache; `dsec node check` says which."""

from __future__ import annotations

import json

from dsec_cli.run import images

from .conftest import Published
from .test_sandbox import dsec, lazy_mounts, sandbox


def test_auto_is_lazy_from_remote_and_eager_when_cached(node_env: dict[str, str],
                                                        s3_image: Published) -> None:
    state = node_env["DSEC_STATE_DIR"]
    with sandbox(node_env, s3_image.image) as sid:  # no --fetch: auto
        rec = next(r for r in json.loads(dsec(node_env, "ps", "--json").stdout)
                   if r["id"] == sid)
        assert rec["fetch"]["mode"] == "lazy" and len(lazy_mounts(state)) == 1
    # an eager run leaves the image in the node's layer cache: nothing is left to fetch
    dsec(node_env, "run", "--fetch", "eager", s3_image.image, "--", "true")
    with sandbox(node_env, s3_image.image) as sid:
        rec = next(r for r in json.loads(dsec(node_env, "ps", "--json").stdout)
                   if r["id"] == sid)
        assert rec.get("fetch") is None and lazy_mounts(state) == []
    assert lazy_mounts(state) == []


def test_auto_is_eager_from_a_local_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert images.fetch_report(str(tmp_path))["auto"] == "eager"


def test_node_info_reports_the_auto_mode(node_env: dict[str, str]) -> None:
    from dsec_cli.run.node import Node

    info = Node(node_env["DSEC_STATE_DIR"], node_env["DSEC_STORE"]).info()
    assert info["fetch"]["auto"] == "lazy"
    assert info["fetch"]["lazy"] in ("fuse daemon", "kernel passthrough")
