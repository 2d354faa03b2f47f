"""The store contract, run against every registered scheme (`core.schemes.SCHEMES`:
file://, s3://, oci:// and any added): ranged reads, missing objects, mutable keys, atomic
ref updates, listing what refs reach, key validation, write batches.

`URL_MAKERS` says how a test makes a new, empty store of each scheme (the servers some need
are the session fixtures ``s3_server`` and ``registry``, tests/push/conftest.py); a scheme
registered without one fails the suite, so a new store cannot go untested. `CONTRACT` lists
the checks, for a test that runs them on a store of its own (tests/push/test_schemes.py)."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsec_cli.core.digests import object_key
from dsec_cli.core.errors import NotFoundError, UsageError
from dsec_cli.core.schemes import SCHEMES
from dsec_cli.format.refs import get_ref, list_refs, set_ref
from dsec_cli.push import testing
from dsec_cli.push.stores import open_store
from dsec_cli.push.stores.base import Store
from dsec_cli.push.stores.retrying import RetryingStore

from ..push.helpers import put_object, raw_layer

#: scheme -> the URL of a new, empty store of it, with its options in the URL itself
#: (endpoint, plain HTTP) so that subprocesses can use it as it is
URL_MAKERS: dict[str, Callable[[pytest.FixtureRequest], str]] = {}


def url_maker(scheme: str) -> Callable[[Callable[[pytest.FixtureRequest], str]],
                                       Callable[[pytest.FixtureRequest], str]]:
    def add(make: Callable[[pytest.FixtureRequest], str]) -> Callable[[pytest.FixtureRequest],
                                                                         str]:
        URL_MAKERS[scheme] = make
        return make

    return add


def _name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@url_maker("file")
def _file_url(request: pytest.FixtureRequest) -> str:
    tmp: Path = request.getfixturevalue("tmp_path")
    return (tmp / f"store-{_name()}").as_uri()


@url_maker("s3")
def _s3_url(request: pytest.FixtureRequest) -> str:
    endpoint = request.getfixturevalue("s3_server")
    bucket = _name()
    testing.create_bucket(endpoint, bucket)
    return f"s3://{bucket}/pre?endpoint_url={endpoint}"


@url_maker("oci")
def _oci_url(request: pytest.FixtureRequest) -> str:
    host = request.getfixturevalue("registry")
    return f"oci://{host}/dsec/{_name()}?insecure=1"


def store_url(request: pytest.FixtureRequest, scheme: str) -> str:
    if scheme not in URL_MAKERS:
        pytest.fail(f"no test store for the {scheme}:// scheme: add a maker to "
                    "tests/conformance/stores.py URL_MAKERS")
    return URL_MAKERS[scheme](request)


@pytest.fixture(params=sorted(SCHEMES))
def any_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    store = open_store(store_url(request, request.param))
    yield store
    store.close()


def test_put_get_ranges_stat(any_store: Store) -> None:
    data = os.urandom(300_000)
    digest = put_object(any_store, "packs", data)
    key = object_key("packs", digest)
    assert any_store.get(key) == data
    assert any_store.get(key, 1000, 4096) == data[1000:5096]
    assert any_store.get(key, 299_990) == data[299_990:]
    assert any_store.get(key, 0, 0) == b""
    assert any_store.get(key, 400_000) == b""  # past the end reads as empty, as a file does
    info = any_store.stat(key)
    assert info is not None and info.size == len(data)
    assert any_store.has(key)


def test_missing_object(any_store: Store) -> None:
    key = object_key("packs", hashlib.sha256(b"never written").hexdigest())
    assert any_store.stat(key) is None
    assert not any_store.has(key)
    with pytest.raises(NotFoundError):
        any_store.get(key)
    with pytest.raises(NotFoundError):
        any_store.get("pins/nothing-here")
    any_store.delete(key)  # deleting what is not there is not an error
    any_store.delete("pins/nothing-here")


def test_put_file(any_store: Store, tmp_path) -> None:
    data = os.urandom(2 << 20)
    path = tmp_path / "pack"
    path.write_bytes(data)
    key = object_key("packs", hashlib.sha256(data).hexdigest())
    any_store.put_file(key, path)
    assert any_store.get(key, 1 << 20, 10) == data[(1 << 20):(1 << 20) + 10]


def test_mutable_keys_list_and_delete(any_store: Store) -> None:
    any_store.put("pins/a", b'{"manifest": 1}')
    any_store.put("pins/b", b"two")
    any_store.put("leases/x", b"three")
    assert sorted(i.key for i in any_store.list("pins/")) == ["pins/a", "pins/b"]
    assert {i.key: i.size for i in any_store.list("pins/")}["pins/b"] == 3
    assert any_store.get("pins/a", 2, 8) == b'{"manifest": 1}'[2:10]
    any_store.delete("pins/a")
    assert [i.key for i in any_store.list("pins/")] == ["pins/b"]
    assert any_store.get("leases/x") == b"three"


def test_atomic_ref_update(any_store: Store) -> None:
    """Readers racing a writer see the old or the new ref, never a torn or missing one."""
    first = raw_layer(any_store, "app", "1+build.2", [os.urandom(1000)])
    second = raw_layer(any_store, "other", "1", [os.urandom(1000)])

    def flip(i: int) -> None:
        set_ref(any_store, "app", "1+build.2", second if i % 2 else first)

    # read as dsec reads, through the retry layer: distribution's filesystem driver answers
    # 500 to a read racing a tag update, a transient error that a retry resolves
    reader = RetryingStore(any_store)

    def read(_: int) -> str:
        return get_ref(reader, "app@1+build.2").manifest

    with ThreadPoolExecutor(4) as pool:
        writes = [pool.submit(flip, i) for i in range(10)]
        seen = set(pool.map(read, range(20)))
        for w in writes:
            w.result()
    assert seen <= {first, second}
    set_ref(any_store, "app", "1+build.2", second)
    assert get_ref(any_store, "app@1+build.2").manifest == second
    assert [r.ref for r in list_refs(any_store)] == ["app@1+build.2", "other@1"]


def test_list_objects_reached_by_refs(any_store: Store) -> None:
    """Every store lists the objects its refs reach (OCI, which cannot list blobs, walks
    the refs' artifact manifests)."""
    packs = [os.urandom(500), os.urandom(600)]
    m = raw_layer(any_store, "lib", "2", packs)
    listed = {i.key: i.size for i in any_store.list("packs/")}
    for p in packs:
        assert listed[object_key("packs", hashlib.sha256(p).hexdigest())] == len(p)
    assert object_key("manifests", m) in {i.key for i in any_store.list("manifests/")}
    assert len([i for i in any_store.list("") if i.key.startswith("indexes/")]) == 1


def test_invalid_keys_rejected(any_store: Store) -> None:
    for bad in ("../escape", "/abs", "a//b", "refs/x/..", ""):
        with pytest.raises(UsageError):
            any_store.put(bad, b"x")


def test_write_batch_shows_every_object_put_inside(any_store: Store, tmp_path) -> None:
    """Inside a batch the writing thread reads its own objects back; after it, everyone
    does (a store may show them as they come or at the end, never lose one)."""
    data = [os.urandom(1000 + n) for n in range(3)]
    path = tmp_path / "f"
    path.write_bytes(b"file" * 100)
    fkey = object_key("packs", hashlib.sha256(path.read_bytes()).hexdigest())
    with any_store.write_batch():
        keys = [object_key("indexes", put_object(any_store, "indexes", d)) for d in data]
        any_store.put_file(fkey, path)
        any_store.put("pins/batch", b"pinned")
        assert [any_store.get(k) for k in keys] == data
        assert any_store.has(fkey) and any_store.stat("pins/batch") is not None
    with ThreadPoolExecutor(1) as pool:  # another thread sees them all
        assert pool.submit(lambda: [any_store.get(k) for k in keys]).result() == data
        assert pool.submit(any_store.get, "pins/batch").result() == b"pinned"
    assert any_store.get(fkey) == path.read_bytes()


#: every check of the contract, each taking the store (and ``tmp_path`` where named)
CONTRACT = [test_put_get_ranges_stat, test_missing_object, test_put_file,
            test_mutable_keys_list_and_delete, test_atomic_ref_update,
            test_list_objects_reached_by_refs, test_invalid_keys_rejected,
            test_write_batch_shows_every_object_put_inside]
