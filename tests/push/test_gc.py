"""Store gc: two-phase deletion with a grace period, pins, writer leases, and gc looping
while pushers publish and retire versions that share packs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec_cli.core.errors import StoreError
from dsec_cli.format.closure import closure
from dsec_cli.format.refs import delete_ref, get_ref, list_refs
from dsec_cli.push import api
from dsec_cli.push.gc import gc_store
from dsec_cli.push.lease import DELETING, WriterLease
from dsec_cli.push.materialize import export
from dsec_cli.push.stores import open_store
from dsec_cli.push.stores.base import Store

from .helpers import build_layer, make_tree, raw_layer, tree_digest


def objects(store: Store) -> set[str]:
    return {i.key for p in ("packs/", "indexes/", "manifests/") for i in store.list(p)}


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, make_url: Callable[[str], str]) -> Store:
    return open_store(make_url(request.param))


def test_two_phase_delete_after_grace(store: Store) -> None:
    shared = os.urandom(3000)
    keep = raw_layer(store, "keep", "1", [shared, os.urandom(3000)])
    drop = raw_layer(store, "drop", "1", [shared, os.urandom(3000)])
    live, dead = set(closure(store, keep)), set(closure(store, drop)) - set(closure(store, keep))
    delete_ref(store, "drop@1")

    r = gc_store(store, grace=1.0)  # just written: too recent to mark
    assert r.recent == len(dead) and not r.marked and not r.deleted
    time.sleep(2.1)  # the grace, plus gc's 1 s allowance for whole-second mtimes
    dry = gc_store(store, grace=1.0, dry_run=True)
    assert not dry.would_delete  # phase 1 has not recorded them yet
    r = gc_store(store, grace=1.0)  # phase 1: recorded as candidates
    assert set(r.marked) == dead and not r.deleted
    assert objects(store) >= live | dead
    time.sleep(1.1)
    dry = gc_store(store, grace=1.0, dry_run=True)
    assert set(dry.would_delete) == dead and objects(store) >= dead
    r = gc_store(store, grace=1.0)  # phase 2: still unreachable after the grace: deleted
    assert set(r.deleted) == dead and r.freed_bytes > 0
    assert objects(store) == live
    assert r.reachable == len(live)


def test_pins_keep_what_running_sandboxes_use(store: Store) -> None:
    m = raw_layer(store, "img", "1", [os.urandom(100)])
    store.put("pins/sbx-1", json.dumps({"manifests": [m]}).encode())
    delete_ref(store, "img@1")
    r = gc_store(store, grace=0)
    keys = set(closure(store, m))
    assert r.pins == 1 and not r.deleted and objects(store) == keys
    store.delete("pins/sbx-1")
    assert set(gc_store(store, grace=0).deleted) == keys


def test_live_writer_lease_defers_deletion(store: Store) -> None:
    m = raw_layer(store, "old", "1", [os.urandom(100)])
    keys = set(closure(store, m))
    delete_ref(store, "old@1")
    with WriterLease(store, "push"):
        r = gc_store(store, grace=0)
        assert r.leases_live == 1 and "lease" in r.deferred and not r.deleted
        assert store.stat(DELETING) is None  # the marker is dropped when gc gives up
    r = gc_store(store, grace=0)
    assert set(r.deleted) == keys


def test_writer_waits_for_a_deleting_gc(store: Store) -> None:
    now = time.time()
    store.put(DELETING, json.dumps({"purpose": "gc", "holder": "other", "started": now,
                                    "expires": now + 60}).encode())
    with pytest.raises(StoreError, match="being garbage-collected"):
        with WriterLease(store, "push", wait_timeout=0.3):
            pass
    assert not list(store.list("leases/"))  # the lease was released
    store.put(DELETING, json.dumps({"purpose": "gc", "holder": "crashed", "started": now - 99,
                                    "expires": now - 1}).encode())
    with WriterLease(store, "push"):  # an expired marker (crashed gc) does not block
        pass


def test_candidate_reused_by_a_push_is_kept(store: Store) -> None:
    pack = os.urandom(1000)
    raw_layer(store, "v", "1", [pack])
    delete_ref(store, "v@1")
    r = gc_store(store, grace=3600)  # objects are recent: nothing marked
    assert r.recent == 3
    pending = {k: 0.0 for k in objects(store)}  # as if marked long ago
    store.put("gc/pending", json.dumps({"candidates": pending}).encode())
    m2 = raw_layer(store, "v", "2", [pack])  # a new version reuses the candidate pack
    r = gc_store(store, grace=3600)
    assert r.resurrected == 1
    assert set(closure(store, m2)) <= objects(store)


def test_dangling_ref_stops_deletion(store: Store) -> None:
    m = raw_layer(store, "a", "1", [os.urandom(10)])
    raw_layer(store, "b", "1", [os.urandom(10)])
    delete_ref(store, "b@1")
    store.delete(f"manifests/{m[:2]}/{m}")
    r = gc_store(store, grace=0)
    assert r.dangling and "cannot be walked" in r.deferred and not r.deleted


def test_gc_cli(make_url: Callable[[str], str]) -> None:
    url = make_url("s3")
    with open_store(url) as s:
        raw_layer(s, "x", "1", [b"x"])
        raw_layer(s, "y", "1", [b"y"])
        delete_ref(s, "y@1")
    dsec = str(Path(sys.executable).with_name("dsec"))
    out = subprocess.run([dsec, "gc", "--store", url, "--grace", "0", "--dry-run", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["store"]["would_delete"]) == 3
    out = subprocess.run([dsec, "gc", "--store", url, "--grace", "0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "deleted 3 objects" in out.stdout
    out = subprocess.run([dsec, "gc", "--store", url, "--grace", "soon"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--grace" in out.stderr


def test_concurrent_pushers_and_gc(make_url: Callable[[str], str], tmp_path: Path) -> None:
    """Two pushers publish successive versions (each reusing the previous version's packs)
    and retire the old ones, while gc loops with no grace at all. Every published version
    must stay complete; at the end every ref exports byte-exact and the garbage is gone."""
    dst_url, rounds = make_url("s3"), 6
    expected: dict[str, dict[str, str]] = {}
    sources = {}
    for p in range(2):  # builds first: the race under test is push vs gc
        src_url = make_url("file")
        sources[p] = src_url
        specs = tmp_path / f"p{p}"
        tree = make_tree(specs / "tree", seed=10 + p, files=10)
        rnd = random.Random(p)
        for v in range(1, rounds + 1):
            (tree / "d0" / f"f{rnd.randrange(10) // 3 * 3}.bin").write_bytes(os.urandom(3000))
            build_layer(src_url, specs, f"p{p}", str(v))
            expected[f"p{p}@{v}"] = tree_digest(tree)
    stop = threading.Event()
    errors: list[BaseException] = []
    gcs = []

    def pusher(p: int) -> None:
        try:
            with open_store(dst_url) as dst:
                for v in range(1, rounds + 1):
                    if v > 1:  # retire first: the new version then reuses unreachable packs
                        api.rmi([f"p{p}@{v - 1}"], store=dst_url)
                    api.push([f"p{p}@{v}"], dst_url, store=sources[p], jobs=4)
                    m = get_ref(dst, f"p{p}@{v}").manifest
                    missing = [k for k in closure(dst, m) if not dst.has(k)]
                    assert not missing, f"p{p}@{v} lost {missing} to gc"
        except BaseException as e:  # noqa: B902 - reported by the main thread
            errors.append(e)

    def collector() -> None:
        try:
            with open_store(dst_url) as dst:
                while not stop.is_set() and len(gcs) < 200:
                    gcs.append(gc_store(dst, grace=0))
        except BaseException as e:  # noqa: B902 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=pusher, args=(p,)) for p in range(2)]
    gc_thread = threading.Thread(target=collector)
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    gc_thread.join(300)
    assert not errors, errors
    assert len(gcs) >= 2
    with open_store(dst_url) as dst:
        final = gc_store(dst, grace=0)
        refs = [r.ref for r in list_refs(dst)]
        assert refs == [f"p0@{rounds}", f"p1@{rounds}"]
        reach = {k for r in list_refs(dst) for k in closure(dst, r.manifest)}
        assert objects(dst) == reach, "unreachable objects survived gc"
        assert final.unreachable == len(final.deleted)
    for ref in refs:
        local = make_url("file")
        api.pull([ref], dst_url, store=local)
        out = tmp_path / f"out-{ref}"
        with open_store(local) as s:
            export(s, ref, out)
        assert tree_digest(out / "data") == expected[ref]


def test_stale_temp_files_of_killed_writers_are_removed(make_url: Callable[[str], str]) -> None:
    store = open_store(make_url("file"))
    staging = Path(store.staging_dir())  # type: ignore[attr-defined]
    old, fresh = staging / "dead.tmp", staging / "busy.tmp"
    old.write_bytes(b"half a pack")
    fresh.write_bytes(b"being written")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with WriterLease(store, "build"):
        assert gc_store(store, grace=0).temp_files_removed == 0  # never while writers run
    os.environ["DSEC_LEASE_TTL"] = "3600"
    try:
        assert gc_store(store, grace=0).temp_files_removed == 1
    finally:
        del os.environ["DSEC_LEASE_TTL"]
    assert fresh.exists() and not old.exists()


def test_mostly_dead_live_packs_are_reported(make_url: Callable[[str], str],
                                             tmp_path: Path) -> None:
    url = make_url("file")
    specs = tmp_path / "specs"
    tree = make_tree(specs / "tree", seed=5, files=10)
    big = tree / "d0" / "keep.bin"
    big.write_bytes(os.urandom(100_000))
    v1 = build_layer(url, specs, "lib", "1")
    for f in tree.rglob("f*.bin"):  # every file but keep.bin changes
        f.write_bytes(os.urandom(max(1, f.stat().st_size)))
    build_layer(url, specs, "lib", "2")
    with open_store(url) as s:
        old_pack = load_manifest_packs(s, v1)
        delete_ref(s, "lib@1")
        r = gc_store(s, grace=0)
        cands = {c["pack"]: c for c in r.repack_candidates}
        assert old_pack in cands  # still reached by v2 (keep.bin), mostly dead
        assert 0.5 < cands[old_pack]["dead_fraction"] < 1
        assert cands[old_pack]["live_bytes"] >= 100_000 * 0.9
        assert s.has(f"packs/{old_pack[:2]}/{old_pack}")


def load_manifest_packs(store: Store, digest: str) -> str:
    from dsec_cli.format.manifest import load_manifest

    (pack,) = load_manifest(store, digest).packs
    return pack
