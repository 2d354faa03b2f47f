"""Versions are immutable: `build`, `push` and `pull` refuse to move a NAME@VERSION that a
store already holds with other content (exit 2, both digests named, the store untouched)
unless `--replace` is given; an unchanged rebuild or push is a no-op."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dsec_cli.format.refs import get_ref
from dsec_cli.push.stores import open_store

from .conftest import store_snapshot

DIGEST = re.compile(r"\b[0-9a-f]{64}\b")


def _spec(folder: Path, content: str) -> Path:
    (folder / "files").mkdir(parents=True, exist_ok=True)
    (folder / "files/app.txt").write_text(content)
    spec = folder / "app.yaml"
    spec.write_text('layer: app\nversion: "1"\nsteps:\n  - copy: {src: ./files, dst: /app}\n')
    return spec


def _ref(store: Path, ref: str = "app@1") -> str:
    return get_ref(open_store(str(store)), ref).manifest


def test_build_refuses_to_move_a_version(tmp_path: Path, run_dsec) -> None:
    store = tmp_path / "store"
    spec = _spec(tmp_path / "s", "one\n")
    first = json.loads(run_dsec("build", str(spec), "--store", str(store), "--json").stdout)
    old = first["items"][0]["manifest"]
    again = json.loads(run_dsec("build", str(spec), "--store", str(store), "--json").stdout)
    assert again["items"][0]["cached"] and again["items"][0]["manifest"] == old

    _spec(tmp_path / "s", "two\n")
    p = run_dsec("build", str(spec), "--store", str(store), check=2)
    named = set(DIGEST.findall(p.stderr))
    assert old in named and len(named) == 2, p.stderr
    assert "app@1" in p.stderr and "--replace" in p.stderr and "Traceback" not in p.stderr
    assert _ref(store) == old  # the ref did not move

    p = run_dsec("build", str(spec), "--store", str(store), "--replace", "--json")
    item = json.loads(p.stdout)["items"][0]
    new = (named - {old}).pop()
    assert item["manifest"] == new and item["replaced"] == old and _ref(store) == new


def test_push_and_pull_refuse_to_move_a_version(tmp_path: Path, run_dsec) -> None:
    local, remote, other = tmp_path / "local", tmp_path / "remote", tmp_path / "other"
    spec = _spec(tmp_path / "s", "one\n")
    run_dsec("build", str(spec), "--store", str(local))
    old = _ref(local)
    run_dsec("push", "app@1", "--store", str(local), "--to", str(remote))
    run_dsec("push", "app@1", "--store", str(local), "--to", str(remote))  # unchanged: fine

    _spec(tmp_path / "s", "two\n")
    run_dsec("build", str(spec), "--store", str(local), "--replace")
    new = _ref(local)
    assert new != old
    before = store_snapshot(remote)
    p = run_dsec("push", "app@1", "--store", str(local), "--to", str(remote), check=2)
    assert old in p.stderr and new in p.stderr and "--replace" in p.stderr, p.stderr
    assert store_snapshot(remote) == before  # refused before anything was copied
    assert _ref(remote) == old

    # pull into a local store that holds the version with other content: the same rule
    run_dsec("build", str(spec), "--store", str(other))
    p = run_dsec("pull", "app@1", "--from", str(remote), "--store", str(other), check=2)
    assert old in p.stderr and new in p.stderr, p.stderr
    assert _ref(other) == new

    out = run_dsec("push", "app@1", "--store", str(local), "--to", str(remote), "--replace")
    assert f"replaced {old[:12]}" in out.stdout and _ref(remote) == new
    run_dsec("pull", "app@1", "--from", str(remote), "--store", str(other))  # same: fine
