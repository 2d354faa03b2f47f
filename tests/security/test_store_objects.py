"""A store writer is untrusted: crafted refs, manifests, indexes and packs, written through
the store API, can at most break the images that use them.

Covered: a manifest's content digest naming a host path or escaping the node cache, a layer
claiming another layer's content digest (cross-tenant cache poisoning), a table of malformed
fields (exit 2, the object named, no traceback), decompression bombs in an index and in a
chunk, one bad object beside good ones (ls, inspect, build, gc), and `dsec verify`.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zstandard

from dsec_cli.core.digests import object_key, put_object, ref_key
from dsec_cli.format import canonical
from dsec_cli.format.index import ChunkLoc, Entry, LayerIndex
from dsec_cli.format.manifest import Manifest, load_manifest, put_manifest
from dsec_cli.format.pack import HEADER
from dsec_cli.format.refs import get_ref, set_ref
from dsec_cli.push.stores import Store, open_store
from tests.conftest import build_store

REPO = Path(__file__).resolve().parents[2]
VICTIM = "busybox@1.35-1"
MOTD = b"Welcome to a dsec sandbox.\n"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def dsec(env: dict[str, str], *args: str, check: int | None = None
         ) -> subprocess.CompletedProcess[str]:
    """The real command line; returns the process (stdout, stderr as text)."""
    p = subprocess.run([sys.executable, "-c", "from dsec_cli.cli import main; main()", *args],
                       capture_output=True, text=True, env={**os.environ, **env,
                                                            "COLUMNS": "200"}, timeout=600)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def refused(p: subprocess.CompletedProcess[str], *names: str) -> None:
    """Exit 2, a clear error naming every one of `names`, no Python traceback."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    for n in names:
        assert n in p.stderr, (n, p.stderr)


def build_into(url: str, folder: Path, data_home: Path) -> None:
    build_store([folder], url, data_home)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A store holding the victim's busybox layer and a small layer of plain files."""
    base = tmp_path_factory.mktemp("store-objects")
    subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
    specs = base / "specs"
    (specs / "tree/sub").mkdir(parents=True)
    (specs / "tree/a.txt").write_bytes(b"alpha\n" * 1000)
    (specs / "tree/sub/b.bin").write_bytes(os.urandom(70_000))
    (specs / "tree/link").symlink_to("a.txt")
    (specs / "small.yaml").write_text(
        'layer: small\nversion: "1"\nsteps:\n  - copy: {src: ./tree, dst: /data}\n')
    url = (base / "store").as_uri()
    build_into(url, REPO / "layerspecs/busybox/busybox.yaml", base / "data")
    build_into(url, specs / "small.yaml", base / "data")
    return {"url": url, "data": base / "data"}


@pytest.fixture
def env(shared: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """A fresh node (state dir) per test over the shared store."""
    return {"DSEC_STORE": shared["url"], "DSEC_STATE_DIR": str(tmp_path / "node"),
            "XDG_DATA_HOME": str(shared["data"])}


@pytest.fixture
def store(shared: dict[str, Any]) -> Store:
    return open_store(shared["url"])


def manifest_of(st: Store, ref: str) -> tuple[str, Manifest]:
    digest = get_ref(st, ref).manifest
    return digest, load_manifest(st, digest)


def publish(st: Store, name: str, m: Manifest) -> str:
    digest = put_manifest(st, replace(m, name=name, version="1"))
    set_ref(st, name, "1", digest)
    return digest


def image(st: Store, name: str, layers: list[str]) -> str:
    return publish(st, name, Manifest(kind="image", name=name, version="1", layers=layers))


def index_doc(st: Store, m: Manifest) -> dict[str, Any]:
    raw = zstandard.ZstdDecompressor().decompress(st.get(object_key("indexes", str(m.index))))
    doc: dict[str, Any] = json.loads(raw)
    return doc


def put_index_doc(st: Store, doc: Any) -> str:
    return put_object(st, "indexes", zstandard.ZstdCompressor().compress(canonical.dumps(doc)))


# -- names that become paths -------------------------------------------------------------------
@root_only
def test_content_digest_naming_a_host_dir_is_refused(store: Store, env: dict[str, str],
                                                      tmp_path: Path) -> None:
    """Today the node cache joins the claim to its root: an absolute path names the host
    directory itself, which the sandbox then sees as a layer."""
    host = tmp_path / "hostdir"
    host.mkdir()
    (host / "secret.txt").write_text("host secret\n")
    before = sorted(p.name for p in host.iterdir())
    victim_digest, victim = manifest_of(store, VICTIM)
    evil = publish(store, "hostpath", replace(victim, content_digest=str(host)))
    image(store, "hostpath-img", [victim_digest, evil])
    p = dsec(env, "run", "hostpath-img@1", "--backend", "fncall", "--", "cat", "/secret.txt")
    refused(p, f"manifest {evil[:12]}", "content_digest")
    assert "host secret" not in p.stdout
    assert sorted(p.name for p in host.iterdir()) == before
    assert (host / "secret.txt").read_text() == "host secret\n"


@root_only
def test_content_digest_escaping_the_cache_is_refused(store: Store, env: dict[str, str]
                                                      ) -> None:
    """``../../x`` would materialize the layer's files outside the node cache."""
    _, victim = manifest_of(store, VICTIM)
    escape = "../../escaped-layer"
    evil = publish(store, "dotdot", replace(victim, content_digest=escape))
    p = dsec(env, "run", "dotdot@1", "--backend", "fncall", "--", "true")
    refused(p, f"manifest {evil[:12]}", "content_digest")
    cache_layers = Path(env["DSEC_STATE_DIR"]) / "cache" / "layers"
    landed = (cache_layers / escape).resolve()
    assert not landed.exists() and not any(Path(env["DSEC_STATE_DIR"]).rglob("escaped-layer"))


@root_only
@pytest.mark.parametrize("fetch", ["eager", "lazy"])
def test_claiming_another_layers_content_digest_is_refused(
        fetch: str, store: Store, env: dict[str, str], shared: dict[str, Any], tmp_path: Path
        ) -> None:
    """An attacker's layer (busybox with another /etc/motd) claims the victim's content
    digest; if the node cached it (or a lazy mount's profile) under that name, every later
    run of the victim's image would get the attacker's files."""
    folder = tmp_path / "evil"
    (folder / "over/etc").mkdir(parents=True)
    (folder / "over/etc/motd").write_text("pwned\n")
    shutil.copy(REPO / "layerspecs/busybox/busybox-rootfs.tar", folder / "rootfs.tar")
    (folder / "evil.yaml").write_text(
        'layer: evilbase\nversion: "1"\nsteps:\n  - extract: {src: ./rootfs.tar, dst: /}\n'
        "  - copy: {src: ./over, dst: /}\n")
    build_into(shared["url"], folder / "evil.yaml", shared["data"])
    _, victim = manifest_of(store, VICTIM)
    _, own = manifest_of(store, "evilbase@1")
    evil = publish(store, "poison", replace(own, content_digest=victim.content_digest))
    backend = ["--backend", "fncall"] if fetch == "eager" else ["--backend", "container"]
    p = dsec(env, "run", "--fetch", fetch, *backend, "poison@1", "--", "cat", "/etc/motd")
    refused(p, f"manifest {evil[:12]}", victim.content_digest, own.content_digest)
    assert "pwned" not in p.stdout
    p = dsec(env, "run", "--fetch", fetch, *backend, VICTIM, "--", "cat", "/etc/motd",
             check=0)
    assert p.stdout == MOTD.decode()


# -- malformed fields --------------------------------------------------------------------------
def _reg(doc: dict[str, Any]) -> dict[str, Any]:
    e: dict[str, Any] = next(e for e in doc["entries"] if e.get("c"))
    return e


def _add(entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["entries"].append({"m": 0o644, "u": 0, "g": 0, "mt": 0, **entry})


INDEX_CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    "chunk-ref-out-of-range": lambda d: _reg(d)["c"][0].__setitem__(0, 10_000),
    "pack-number-out-of-range": lambda d: d["chunks"][0].__setitem__(1, 99),
    "pack-number-a-string": lambda d: d["chunks"][0].__setitem__(1, "0"),
    "negative-offset": lambda d: d["chunks"][0].__setitem__(2, -5),
    "ulen-over-chunk-max": lambda d: d["chunks"][0].__setitem__(4, 1 << 30),
    "unknown-codec": lambda d: d["chunks"][0].__setitem__(5, 9),
    "chunk-id-not-hex": lambda d: d["chunks"][0].__setitem__(0, "zz" * 16),
    "pack-digest-a-path": lambda d: d["packs"].__setitem__(0, "../../etc/passwd"),
    "size-not-sum-of-chunks": lambda d: _reg(d).__setitem__("s", _reg(d)["s"] + 1),
    "extent-past-its-chunk": lambda d: _reg(d)["c"][0].__setitem__(1, 1 << 20),
    "mode-over-7777": lambda d: _reg(d).__setitem__("m", 0o104755 | 0o170000),
    "uid-negative": lambda d: _reg(d).__setitem__("u", -1),
    "gid-over-32-bits": lambda d: _reg(d).__setitem__("g", 1 << 40),
    "mtime-a-string": lambda d: _reg(d).__setitem__("mt", "yesterday"),
    "path-escapes": lambda d: _reg(d).__setitem__("p", "../../etc/shadow"),
    "path-absolute": lambda d: _reg(d).__setitem__("p", "/etc/shadow"),
    "path-twice": _add({"p": "data", "t": "dir"}),
    "unknown-type": _add({"p": "zz", "t": "socket"}),
    "hardlink-target-missing": _add({"p": "zz", "t": "hard", "l": "no/such/file"}),
    "rdev-not-ints": _add({"p": "zz", "t": "chr", "rd": ["a", "b"]}),
    "xattr-name-too-long": lambda d: _reg(d).__setitem__("x", {"user." + "n" * 300: "eA=="}),
    "xattr-value-too-large": lambda d: _reg(d).__setitem__(
        "x", {"user.a": base64.b64encode(bytes(70_000)).decode()}),
    "entries-not-a-list": lambda d: d.__setitem__("entries", {"p": "."}),
    "entry-not-an-object": lambda d: d["entries"].append(7),
    "params-missing": lambda d: d.pop("params"),
    "params-negative": lambda d: d["params"].__setitem__("max", -1),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_malformed_index_field(case: str, store: Store, env: dict[str, str]) -> None:
    _, small = manifest_of(store, "small@1")
    doc = index_doc(store, small)
    INDEX_CASES[case](doc)
    ix = put_index_doc(store, doc)
    name = f"badix-{case}"
    publish(store, name, replace(small, index=ix))
    refused(dsec(env, "inspect", f"{name}@1"), f"index {ix[:12]}")


MANIFEST_CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    "content-digest-host-path": lambda d: d.__setitem__("content_digest", "/etc"),
    "index-a-path": lambda d: d.__setitem__("index", "../../etc/passwd"),
    "pack-a-path": lambda d: d["packs"].append("/root"),
    "kind-unknown": lambda d: d.__setitem__("kind", "blob"),
    "name-with-slash": lambda d: d.__setitem__("name", "a/../b"),
    "size-negative": lambda d: d.__setitem__("size", -1),
    "files-a-string": lambda d: d.__setitem__("files", "many"),
    "env-value-not-string": lambda d: d.__setitem__("env", {"A": 1}),
    "unknown-field": lambda d: d.__setitem__("evil", True),
    "not-an-object": lambda d: d.clear(),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_malformed_manifest_field(case: str, store: Store, env: dict[str, str]) -> None:
    _, small = manifest_of(store, "small@1")
    doc = json.loads(small.to_bytes())
    MANIFEST_CASES[case](doc)
    digest = put_object(store, "manifests", canonical.dumps(doc))
    set_ref(store, f"badm-{case}", "1", digest)
    refused(dsec(env, "inspect", f"badm-{case}@1"), f"manifest {digest[:12]}")


REF_CASES: dict[str, bytes] = {
    "manifest-a-path": b'{"manifest":"../../../etc/passwd","updated":1}',
    "manifest-missing": b'{"updated":1}',
    "updated-a-string": b'{"manifest":"' + b"a" * 64 + b'","updated":"now"}',
    "not-an-object": b"[1,2,3]",
    "not-json": b"\xff\xfe",
    "too-large": b'{"manifest":"' + b"a" * 64 + b'","pad":"' + b"x" * (1 << 20) + b'"}',
}


@pytest.mark.parametrize("case", sorted(REF_CASES))
def test_malformed_ref(case: str, store: Store, env: dict[str, str]) -> None:
    store.put(ref_key(f"badref-{case}", "1"), REF_CASES[case])
    refused(dsec(env, "inspect", f"badref-{case}@1"), f"ref badref-{case}@1")
    # and the store's other refs are still listed
    p = dsec(env, "ls", "--json", check=0)
    assert "small@1" in {i["ref"] for i in json.loads(p.stdout)}


# -- bombs -------------------------------------------------------------------------------------
#: runs the CLI, then prints this process's peak RSS in KiB: VmHWM, which belongs to the new
#: address space (ru_maxrss would carry over the forking test process's peak across exec)
PEAK_RSS_CODE = ("import sys\nfrom dsec_cli.cli import main\ntry:\n    main()\nfinally:\n"
                 "    hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')]\n"
                 "    print('maxrss', int(hwm[0].split()[1]), file=sys.stderr)\n")


def _zeros_frame(n: int, declare: bool) -> bytes:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declare)
    obj = cctx.compressobj(size=n if declare else -1)
    block = bytes(16 << 20)
    out = [obj.compress(block) for _ in range(n // len(block))]
    return b"".join(out) + obj.flush()


@pytest.mark.parametrize("declare", [True, False], ids=["declared-size", "streamed"])
def test_index_bomb_is_refused_within_the_bound(declare: bool, store: Store,
                                                env: dict[str, str]) -> None:
    """1 GiB of JSON zeros in a few KiB: refused once past the configured bound, without
    decompressing it all (the process stays far below the bomb's size)."""
    _, small = manifest_of(store, "small@1")
    bomb = _zeros_frame(1 << 30, declare)
    assert len(bomb) < 1 << 20
    ix = put_object(store, "indexes", bomb)
    publish(store, f"bomb-{int(declare)}", replace(small, index=ix))
    code = PEAK_RSS_CODE
    p = subprocess.run([sys.executable, "-c", code, "inspect", f"bomb-{int(declare)}@1"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env, "DSEC_MAX_INDEX_JSON_BYTES": "64M"})
    refused(p, f"index {ix[:12]}", "index_json_bytes")
    rss_kib = int(p.stderr.rsplit("maxrss", 1)[1].split()[0])
    assert rss_kib < 300 << 10, rss_kib  # far below the 1 GiB the frame expands to


def test_chunk_frame_expanding_past_ulen_is_refused(store: Store, env: dict[str, str],
                                                    tmp_path: Path) -> None:
    """A chunk whose zstd frame declares 512 MiB while the index says 100 bytes: refused
    before anything that size is allocated."""
    frame = _zeros_frame(512 << 20, True)
    pack = put_object(store, "packs", HEADER + frame)
    from dsec_cli.core.digests import chunk_id

    ix = LayerIndex(entries=[Entry(".", "dir", 0o755), Entry("f", "reg", size=100,
                                                            chunks=[(0, 0, 100)])],
                    chunks=[ChunkLoc(chunk_id(bytes(100)), 0, len(HEADER), len(frame), 100, 1)],
                    packs=[pack])
    ixd = put_object(store, "indexes", ix.to_bytes())
    publish(store, "chunkbomb", Manifest(kind="layer", name="x", version="1", index=ixd,
                                         packs=[pack], content_digest=ix.content_digest(),
                                         size=100, files=1))
    code = PEAK_RSS_CODE
    p = subprocess.run([sys.executable, "-c", code, "export", "chunkbomb@1",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env})
    refused(p, pack, "ulen")
    assert int(p.stderr.rsplit("maxrss", 1)[1].split()[0]) < 300 << 10
    assert not (tmp_path / "out").exists()


# -- one bad object among good ones ------------------------------------------------------------
def test_bad_index_does_not_stop_build_ls_or_gc(store: Store, env: dict[str, str],
                                                tmp_path: Path, shared: dict[str, Any]
                                                ) -> None:
    url = (tmp_path / "own").as_uri()  # gc deletes: a store of its own
    own = open_store(url)
    src_digest, small = manifest_of(store, "small@1")
    from dsec_cli.format.closure import closure

    for key in closure(store, src_digest):
        own.put(key, store.get(key))
    set_ref(own, "small", "1", src_digest)
    # the bad layer: its index lists a pack only it knows of, and a field of the wrong type
    hidden = put_object(own, "packs", HEADER + os.urandom(500))
    doc = index_doc(own, small)
    doc["packs"].append(hidden)
    doc["chunks"][0][1] = "0"
    bad_ix = put_index_doc(own, doc)
    publish(own, "badlayer", replace(small, index=bad_ix, packs=small.packs))
    garbage = object_key("packs", put_object(own, "packs", HEADER + os.urandom(300)))
    e = {**env, "DSEC_STORE": url}
    folder = tmp_path / "specs"
    (folder / "t").mkdir(parents=True)
    (folder / "t/x.txt").write_text("x\n")
    (folder / "n.yaml").write_text('layer: n\nversion: "1"\nsteps:\n'
                                   "  - copy: {src: ./t, dst: /t}\n")
    p = dsec(e, "build", str(folder), check=0)
    assert "Traceback" not in p.stderr and bad_ix[:12] in p.stderr, p.stderr
    refs = {i["ref"] for i in json.loads(dsec(e, "ls", "--json", check=0).stdout)}
    assert {"small@1", "badlayer@1", "n@1"} <= refs
    p = dsec(e, "gc", "--grace", "0", check=1)
    assert "Traceback" not in p.stderr and bad_ix[:12] in p.stderr, p.stderr
    assert own.has(object_key("packs", hidden)) and own.has(garbage)
    assert all(own.has(object_key("packs", d)) for d in small.packs)
    dsec(e, "export", "small@1", str(tmp_path / "exported"), check=0)


def test_bad_manifest_is_listed_apart_and_stops_gc_sweeping(
        store: Store, env: dict[str, str], tmp_path: Path) -> None:
    url = (tmp_path / "own").as_uri()
    own = open_store(url)
    src_digest, _ = manifest_of(store, "small@1")
    from dsec_cli.format.closure import closure

    for key in closure(store, src_digest):
        own.put(key, store.get(key))
    set_ref(own, "small", "1", src_digest)
    junk = put_object(own, "manifests", b'{"mediaType":"nope"}')
    set_ref(own, "junk", "1", junk)
    garbage = object_key("packs", put_object(own, "packs", HEADER + os.urandom(300)))
    e = {**env, "DSEC_STORE": url}
    p = dsec(e, "ls", check=0)
    assert "small@1" in p.stdout and f"manifest {junk[:12]}" in p.stderr
    dsec(e, "inspect", "small@1", check=0)
    refused(dsec(e, "inspect", "junk@1"), f"manifest {junk[:12]}")
    p = dsec(e, "gc", "--grace", "0", check=1)
    assert junk[:12] in p.stderr and own.has(garbage)
    dsec(e, "push", "small@1", "--to", (tmp_path / "far").as_uri(), check=0)


# -- dsec verify -------------------------------------------------------------------------------
def _copy_small(store: Store, tmp_path: Path) -> tuple[str, Store, Manifest]:
    url = (tmp_path / "own").as_uri()
    own = open_store(url)
    digest, small = manifest_of(store, "small@1")
    from dsec_cli.format.closure import closure

    for key in closure(store, digest):
        own.put(key, store.get(key))
    set_ref(own, "small", "1", digest)
    return url, own, small


def test_verify_clean_store(store: Store, env: dict[str, str], tmp_path: Path) -> None:
    url, _, _ = _copy_small(store, tmp_path)
    doc = json.loads(dsec(env, "verify", "--deep", "--store", url, "--json", check=0).stdout)
    assert doc["ok"] and doc["refs"] == 1 and doc["chunks"] > 0 and doc["problems"] == []


def test_verify_deep_finds_a_flipped_byte(store: Store, env: dict[str, str], tmp_path: Path
                                          ) -> None:
    url, own, small = _copy_small(store, tmp_path)
    key = object_key("packs", small.packs[0])
    data = bytearray(own.get(key))
    data[len(HEADER) + 40] ^= 0x01  # inside the first chunk
    own.put(key, bytes(data))
    dsec(env, "verify", "--store", url, check=0)  # shallow: the pack is there
    p = dsec(env, "verify", "--deep", "--store", url, check=1)
    assert f"pack {small.packs[0][:12]}" in p.stdout and "chunk" in p.stdout, p.stdout
    assert "Traceback" not in p.stderr


def test_verify_finds_a_missing_pack(store: Store, env: dict[str, str], tmp_path: Path
                                     ) -> None:
    url, own, small = _copy_small(store, tmp_path)
    own.delete(object_key("packs", small.packs[0]))
    p = dsec(env, "verify", "--store", url, check=1)
    assert f"pack {small.packs[0][:12]}" in p.stdout and "missing" in p.stdout, p.stdout
    doc = json.loads(dsec(env, "verify", "small@1", "--store", url, "--json", check=1).stdout)
    assert [(x["kind"], x["name"]) for x in doc["problems"]] == [("pack", small.packs[0])]
