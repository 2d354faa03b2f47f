"""`dsec import`: OCI layouts, docker save tarballs and registry images become dsec layers
and images with the tree, metadata and config of the image; layers already imported cost
nothing; the streamed chunker cuts as the whole-file chunker does."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from dsec_cli.api import images, oci
from dsec_cli.build.layer import _Writer, chunk_stream
from dsec_cli.core.errors import IntegrityError
from dsec_cli.format.chunker import cut
from dsec_cli.format.index import ChunkParams
from dsec_cli.push.dedup import KnownChunks
from dsec_cli.push.stores import open_store

from .conftest import store_files
from .helpers import Image, base_image, compress, file, layer_tar, sha, skopeo, write_layout


def _tree(path: Path) -> dict[str, tuple[str, int, bytes]]:
    out = {}
    for dirpath, dirs, names in os.walk(path):
        for n in dirs + names:
            p = Path(dirpath) / n
            rel = str(p.relative_to(path))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("sym", 0, os.readlink(p).encode())
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777, b"")
            else:
                out[rel] = ("reg", st.st_mode & 0o7777, p.read_bytes())
    return out


def test_layout_import_gives_the_tree_config_and_free_reimport(env: dict[str, str],
                                                               tmp_path: Path) -> None:
    digests = write_layout(base_image(), tmp_path / "layout")
    r = oci.import_image(str(tmp_path / "layout"), as_ref="base@1")
    assert [x.diff_id for x in r.layers] == json.loads(digests["diff_ids"])
    assert [x.ref for x in r.layers] == [f"oci-layer@{d[7:]}"
                                         for d in json.loads(digests["diff_ids"])]
    assert r.source_digest == digests["manifest"]
    images.export_image("base@1", tmp_path / "tree")
    tree = _tree(tmp_path / "tree")
    assert "opt/app/old.txt" not in tree  # whiteout applied
    assert tree["opt/app/keep.txt"] == ("reg", 0o644, b"keep")
    assert "var/cache/a" not in tree and tree["var/cache/b"][2] == b"b" * 50  # opaque dir
    assert tree["etc/link"] == ("sym", 0, b"hostname")
    assert os.stat(tmp_path / "tree/etc/hard").st_ino == os.stat(
        tmp_path / "tree/etc/hostname").st_ino
    assert tree["bin-tool"][1] == 0o755
    assert tree["opt/big.bin"][2] == base_image().layers[0][6].data
    doc = images.inspect("base@1")
    m = doc["manifest"]
    assert doc["env"] == {"PATH": "/usr/bin:/bin", "GREETING": "hi"}
    assert doc["workdir"] == "/work"
    assert json.loads(m["annotations"]["oci.entrypoint"]) == ["/bin/sh", "-c"]
    assert json.loads(m["annotations"]["oci.cmd"]) == ["echo hello"]
    assert m["annotations"]["oci.user"] == "0:0"
    assert m["annotations"]["oci.label.org.example.kind"] == "test"

    before = store_files(env)
    again = oci.import_image(str(tmp_path / "layout"), as_ref="base@1")
    assert all(x.reused for x in again.layers) and again.bytes_read == 0
    assert again.manifest == r.manifest
    assert store_files(env).keys() == before.keys()


def test_layer_shared_by_two_images_is_read_once(env: dict[str, str], tmp_path: Path) -> None:
    img = base_image()
    write_layout(img, tmp_path / "a")
    other = Image([img.layers[0], [file("srv/other.txt", b"other")]], ["gzip", "none"])
    write_layout(other, tmp_path / "b")
    oci.import_image(str(tmp_path / "a"), as_ref="a@1")
    r = oci.import_image(str(tmp_path / "b"), as_ref="b@1")
    assert [x.reused for x in r.layers] == [True, False]


def test_round_trip_export_import_and_peers_read_the_export(env: dict[str, str],
                                                            tmp_path: Path) -> None:
    """import -> export --format oci -> import gives the same content digests; skopeo
    reads the export as a docker archive (and dsec imports that too), umoci unpacks it to
    the tree dsec exports."""
    write_layout(base_image(), tmp_path / "layout")
    first = oci.import_image(str(tmp_path / "layout"), as_ref="base@1")
    for compression in ("gzip", "zstd"):
        out = tmp_path / f"out-{compression}"
        e = oci.export_oci("base@1", out, compression=compression)
        assert len(e.layers) == 2
        again = oci.import_image(str(out), as_ref=f"again-{compression}@1")
        assert [x.content_digest for x in again.layers] == \
            [x.content_digest for x in first.layers]
        assert images.inspect(f"again-{compression}@1")["env"] == images.inspect("base@1")["env"]
    # deterministic: the same image exports to the same OCI digests
    assert oci.export_oci("base@1", tmp_path / "out2").manifest_digest == \
        oci.export_oci("base@1", tmp_path / "out3").manifest_digest

    archive = tmp_path / "image.tar"
    skopeo("copy", f"oci:{tmp_path / 'out-gzip'}", f"docker-archive:{archive}:test/base:1")
    via_docker = oci.import_image(str(archive), as_ref="docker@1")
    assert [x.content_digest for x in via_docker.layers] == \
        [x.content_digest for x in first.layers]
    doc = images.inspect("docker@1")
    assert doc["workdir"] == "/work" and doc["env"]["GREETING"] == "hi"

    import subprocess

    bundle = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{tmp_path / 'out-gzip'}:1", str(bundle)],
                   check=True, capture_output=True, timeout=300)
    images.export_image("base@1", tmp_path / "tree")
    assert _tree(bundle / "rootfs") == _tree(tmp_path / "tree")
    runtime = json.loads((bundle / "config.json").read_text())
    assert runtime["process"]["cwd"] == "/work"
    assert "GREETING=hi" in runtime["process"]["env"]
    assert runtime["process"]["args"] == ["/bin/sh", "-c", "echo hello"]


def test_registry_import_by_tag_and_digest_and_export_to_registry(
        env: dict[str, str], tmp_path: Path, registry: str, run_dsec) -> None:  # type: ignore[no-untyped-def]
    write_layout(base_image(), tmp_path / "layout")
    skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'layout'}:v1",
           f"docker://{registry}/lib/base:v1")
    p = run_dsec("import", f"{registry}/lib/base:v1", "--insecure", "--json")
    r = json.loads(p.stdout)
    assert r["ref"] == "base@v1" and len(r["layers"]) == 2
    digest = r["source_digest"]
    p = run_dsec("import", f"{registry}/lib/base@{digest}", "--insecure", "--as", "pinned@1",
                 "--json")
    r2 = json.loads(p.stdout)
    assert r2["source_digest"] == digest and all(x["reused"] for x in r2["layers"])
    # out to the registry, and back
    p = run_dsec("export", "base@v1", "--to-registry", f"{registry}/lib/out:x", "--insecure",
                 "--json")
    assert json.loads(p.stdout)["registry"] == f"{registry}/lib/out:x"
    skopeo("copy", "--src-tls-verify=false", f"docker://{registry}/lib/out:x",
           f"oci:{tmp_path / 'pulled'}:x")
    r3 = json.loads(run_dsec("import", f"{tmp_path / 'pulled'}:x", "--as", "back@1",
                             "--json").stdout)
    assert [x["content_digest"] for x in r3["layers"]] == \
        [x["content_digest"] for x in r["layers"]]


def test_image_index_platform_selection(env: dict[str, str], tmp_path: Path,
                                        run_dsec) -> None:  # type: ignore[no-untyped-def]
    amd = Image([[file("arch", b"amd64")]])
    arm = Image([[file("arch", b"arm64")]])
    lay = tmp_path / "multi"
    manifests = []
    for img, arch in ((amd, "amd64"), (arm, "arm64")):
        write_layout(img, lay, tag=arch)
        entry = json.loads((lay / "index.json").read_text())["manifests"][0]
        entry["platform"] = {"os": "linux", "architecture": arch}
        entry.pop("annotations")
        manifests.append(entry)
    idx = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
           "manifests": manifests}
    data = json.dumps(idx).encode()
    (lay / "blobs/sha256" / sha(data)[7:]).write_bytes(data)
    (lay / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": idx["mediaType"], "digest": sha(data), "size": len(data)}]}))
    run_dsec("import", str(lay), "--as", "m@amd", "--platform", "linux/amd64")
    run_dsec("import", str(lay), "--as", "m@arm", "--platform", "linux/arm64")
    for tag, want in (("amd", b"amd64"), ("arm", b"arm64")):
        images.export_image(f"m@{tag}", tmp_path / tag)
        assert (tmp_path / tag / "arch").read_bytes() == want
    p = run_dsec("import", str(lay), "--platform", "linux/s390x", check=2)
    err = " ".join(p.stderr.split())
    assert "linux/s390x" in err and "linux/arm64" in err


def test_uncompressed_and_zstd_layers(env: dict[str, str], tmp_path: Path) -> None:
    img = Image([[file("a", b"A" * 70000)], [file("b", b"B")], [file("c", b"C")]],
                ["none", "zstd", "gzip"])
    write_layout(img, tmp_path / "l")
    oci.import_image(str(tmp_path / "l"), as_ref="c@1")
    images.export_image("c@1", tmp_path / "t")
    assert {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()} == {
        "a": b"A" * 70000, "b": b"B", "c": b"C"}


def test_sparse_and_plain_members_read_in_stream_order(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    """A GNU sparse member (read through its data map) between plain members (read straight
    from the stream) imports with every file's bytes in place."""
    import subprocess

    src = tmp_path / "src"
    src.mkdir()
    (src / "a-before").write_bytes(b"before" * 5000)
    with open(src / "b-sparse", "wb") as fh:
        fh.seek(300_000)
        fh.write(b"DATA" * 1024)
        fh.truncate(1 << 20)
    (src / "c-after").write_bytes(b"after")
    tar = tmp_path / "layer.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tar), "-C", str(src),
                    "a-before", "b-sparse", "c-after"], check=True)
    import tarfile

    with tarfile.open(tar) as tf:
        assert [m.name for m in tf if m.sparse] == ["b-sparse"]
    write_layout(Image([tar.read_bytes()], ["gzip"]), tmp_path / "l")
    oci.import_image(str(tmp_path / "l"), as_ref="sparse@1")
    images.export_image("sparse@1", tmp_path / "t")
    for name in ("a-before", "b-sparse", "c-after"):
        assert (tmp_path / "t" / name).read_bytes() == (src / name).read_bytes(), name


def test_streamed_chunking_copies_what_it_keeps(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces a stream hands over are views its reader writes over afterwards (as the
    layer reader's pieces are let go): the chunks are those of the bytes as they were read,
    file after file through the one reused window."""
    from dsec_cli.build import layer
    from dsec_cli.core.digests import chunk_id

    buffers = layer._Buffers(keep=8)
    monkeypatch.setattr(layer, "_BUFFERS", buffers)
    params = ChunkParams()
    store = open_store(tmp_path.as_uri())
    w = _Writer(store, KnownChunks(), params, tmp_path, None, False)
    scratch = bytearray(100_000)
    try:
        for seed in (1, 2):
            data = random.Random(seed).randbytes(9 << 20)
            pos = 0

            def read(n: int, data: bytes = data) -> memoryview:
                nonlocal pos
                n = min(n, len(scratch), len(data) - pos)
                scratch[:n] = data[pos:pos + n]
                pos += n
                return memoryview(scratch)[:n]

            got = chunk_stream(w, read, len(data), params)
            scratch[:] = bytes(len(scratch))  # what was handed over is gone now
            whole = list(cut(memoryview(data), params))
            assert [ln for _, _, ln in got] == [ln for _, ln in whole]
            assert [w.ids[n] for n, _, _ in got] == [chunk_id(data[o:o + ln])
                                                     for o, ln in whole]
        # one window, taken for the first file, given back, taken again for the second
        assert len(buffers.free[16 * params.max_size]) == 1
    finally:
        w.abort()


@pytest.mark.parametrize("size", [16 << 10, 200 << 10, 256 << 10, (256 << 10) + 1, 5 << 20,
                                  (4 << 20) + 12345, 12 << 20])
def test_streamed_chunking_matches_whole_file_chunking(tmp_path: Path, size: int) -> None:
    """Read piecewise, in short reads, window by window (the last chunk of each window cut
    again): the same chunks, byte for byte, as the whole file."""
    from dsec_cli.core.digests import chunk_id

    rnd = random.Random(size)
    data = rnd.randbytes(size)
    params = ChunkParams()
    store = open_store(tmp_path.as_uri())
    w = _Writer(store, KnownChunks(), params, tmp_path, None, False)
    try:
        pos = 0

        def read(n: int) -> bytes:
            nonlocal pos
            n = min(n, 70001)  # short reads, as from a network stream
            out = data[pos:pos + n]
            pos += len(out)
            return out

        got = chunk_stream(w, read, size, params)
        lengths = [ln for _, _, ln in got]
        whole = [(0, size)] if size <= params.max_size else list(cut(memoryview(data), params))
        assert lengths == [ln for _, ln in whole]
        assert [w.ids[n] for n, _, _ in got] == [chunk_id(data[o:o + ln]) for o, ln in whole]
    finally:
        w.abort()


def test_docker_save_layout_with_uncompressed_members(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    """A docker save tarball written by hand: manifest.json, the config and layer.tar
    members, as docker writes them."""
    import io
    import tarfile

    plain = layer_tar([file("hello.txt", b"hello")])
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["A=1"], "WorkingDir": "/"},
                         "rootfs": {"type": "layers", "diff_ids": [sha(plain)]}}).encode()
    members = {"abc/layer.tar": plain, "cfg.json": config,
               "manifest.json": json.dumps([{"Config": "cfg.json", "RepoTags": ["x/y:7"],
                                              "Layers": ["abc/layer.tar"]}]).encode()}
    archive = tmp_path / "save.tar"
    with tarfile.open(archive, "w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    r = oci.import_image(f"{archive}:7")
    assert r.ref == "save@7" and images.inspect("save@7")["env"] == {"A": "1"}
    assert r.source_digest == sha(config)
    assert oci.import_image(f"{archive}:7").manifest == r.manifest  # again: no conflict
    assert compress(b"", "none") == b""


def test_registry_that_fails_each_request_twice(env: dict[str, str], tmp_path: Path,
                                                registry: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manifest and blob request meets two 503s first: the import retries them
    (transient errors only) and gets the same image."""
    from tests.flakyproxy import FlakyProxy

    write_layout(base_image(), tmp_path / "layout")
    skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'layout'}:v1",
           f"docker://{registry}/flaky/base:v1")
    direct = oci.import_image(f"{registry}/flaky/base:v1", as_ref="direct@1", insecure=True)
    proxy = FlakyProxy(f"http://{registry}")
    try:
        host = proxy.url.removeprefix("http://")
        monkeypatch.setenv("DSEC_STORE", (tmp_path / "other-store").as_uri())
        r = oci.import_image(f"{host}/flaky/base:v1", as_ref="flaky@1", insecure=True)
        assert proxy.failed >= 2 * 3  # manifest, config and layers each failed first
    finally:
        proxy.stop()
    assert [x.content_digest for x in r.layers] == [x.content_digest for x in direct.layers]


def test_a_layer_is_streamed_not_held_whole(env: dict[str, str], tmp_path: Path) -> None:
    """Importing a 48 MiB layer of incompressible bytes allocates far less than the layer
    (Python allocations traced: the read-ahead queue, chunk windows, chunks in flight)."""
    import tracemalloc

    big = random.Random(7).randbytes(48 << 20)
    write_layout(Image([[file("big", big)]], ["none"]), tmp_path / "l")
    del big
    tracemalloc.start()
    try:
        oci.import_image(str(tmp_path / "l"), as_ref="big@1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"peak {peak >> 20} MiB"
    images.export_image("big@1", tmp_path / "t")
    assert (tmp_path / "t/big").stat().st_size == 48 << 20


def test_a_gzip_bomb_layer_is_inflated_piecewise(env: dict[str, str], tmp_path: Path) -> None:
    """A 64 MiB file that gzip shrinks a thousandfold is inflated a few MiB at a time:
    Python allocations stay far below the file's size."""
    import tracemalloc

    write_layout(Image([[file("zeros", bytes(64 << 20))]], ["gzip"]), tmp_path / "l")
    tracemalloc.start()
    try:
        oci.import_image(str(tmp_path / "l"), as_ref="bomb@1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"peak {peak >> 20} MiB"
    images.export_image("bomb@1", tmp_path / "t")
    assert (tmp_path / "t/zeros").stat().st_size == 64 << 20


def test_gzip_layer_of_several_members(env: dict[str, str], tmp_path: Path) -> None:
    """A gzip blob made of members back to back (as parallel compressors write them) is
    read as one stream."""
    plain = layer_tar([file("a", b"A" * 300_000), file("b", b"B" * 50), file("c", b"C")])
    cut_at = len(plain) // 3
    blob = compress(plain[:cut_at], "gzip") + compress(plain[cut_at:], "gzip")
    lay = tmp_path / "l"
    write_layout(Image([plain]), lay)
    # swap the single-member blob for the two-member one, re-hashing the documents
    index = json.loads((lay / "index.json").read_text())
    mpath = lay / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    manifest = json.loads(mpath.read_text())
    manifest["layers"][0].update(digest=sha(blob), size=len(blob))
    (lay / "blobs/sha256" / sha(blob)[7:]).write_bytes(blob)
    mdata = json.dumps(manifest).encode()
    (lay / "blobs/sha256" / sha(mdata)[7:]).write_bytes(mdata)
    index["manifests"][0].update(digest=sha(mdata), size=len(mdata))
    (lay / "index.json").write_text(json.dumps(index))
    oci.import_image(str(lay), as_ref="multi@1")
    images.export_image("multi@1", tmp_path / "t")
    assert {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()} == {
        "a": b"A" * 300_000, "b": b"B" * 50, "c": b"C"}


def test_imported_layers_chunk_tables_are_kept_for_the_next_import(env: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """Each layer an import writes leaves its chunk table in the data dir, the same table a
    later writer would build by reading the index back from the store."""
    from dsec_cli.format.manifest import load_manifest

    write_layout(base_image(), tmp_path / "l")
    r = oci.import_image(str(tmp_path / "l"), as_ref="t@1")
    tables = Path(env["DSEC_DATA_DIR"]) / "chunk-tables"
    with open_store(env["DSEC_STORE"]) as st:
        for layer in r.layers:
            index = load_manifest(st, layer.manifest).index
            assert index and (tables / index).is_file(), layer.ref
        cached = KnownChunks.load(st, tables).chunks
        assert cached and cached == KnownChunks.load(st, None).chunks


def test_chunk_tables_parsed_once_per_process_give_the_same_chunks(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second load in the same process takes the tables it parsed before (no disk read)
    and knows exactly the chunks a load from the tables on disk, or from the indexes, does."""
    from dsec_cli.push import dedup

    write_layout(base_image(), tmp_path / "l")
    oci.import_image(str(tmp_path / "l"), as_ref="t@1")
    tables = Path(env["DSEC_DATA_DIR"]) / "chunk-tables"
    monkeypatch.setattr(dedup, "_READ_TABLES", {})
    monkeypatch.setattr(dedup, "_READ_ROWS", 0)
    with open_store(env["DSEC_STORE"]) as st:
        first = KnownChunks.load(st, tables).chunks
        assert len(dedup._READ_TABLES) == 2  # both layers' tables, read from disk
        reads = []
        real = dedup._read_table
        monkeypatch.setattr(dedup, "_read_table", lambda *a: reads.append(1) or real(*a))
        again = KnownChunks.load(st, tables).chunks
        assert not reads and again == first == KnownChunks.load(st, None).chunks
        again.clear()  # a loaded set is the caller's own: the tables read are unchanged
        assert KnownChunks.load(st, tables).chunks == first


def test_no_staging_left_after_an_import_or_a_refused_one(env: dict[str, str],
                                                          tmp_path: Path) -> None:
    """Each layer's staging directory (its packs until publish) is gone when the import
    returns, whether it published or refused the image."""
    write_layout(base_image(), tmp_path / "ok")
    write_layout(Image([[file("z", b"z" * 5000)], [file("y", b"y")]]), tmp_path / "bad",
                 tamper=1)
    with open_store(env["DSEC_STORE"]) as st:
        staging = st.staging_dir()
        oci.import_image(str(tmp_path / "ok"), as_ref="ok@1")
        assert not list(staging.glob("import-*"))
        with pytest.raises(IntegrityError, match="layer sha256:"):
            oci.import_image(str(tmp_path / "bad"), as_ref="bad@1")
        assert not list(staging.glob("import-*"))


def test_small_files_past_the_spool_memory_go_to_a_file(env: dict[str, str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Small files wait in memory until the layer's end, then past `SPOOL_MEMORY` in a
    staging file: the layer is the same, to the content digest, either way."""
    from dsec_cli.build import ociimport

    rnd = random.Random(7)
    members = [file(f"srv/f{i:03d}", rnd.randbytes(rnd.randrange(1, 12_000))) for i in range(60)]
    members.append(file("srv/big", rnd.randbytes(300_000)))
    write_layout(Image([members]), tmp_path / "l")
    first = oci.import_image(str(tmp_path / "l"), as_ref="small@1")
    spilled: list[int] = []
    real = ociimport.layers.Spool.add

    def add(self: ociimport.layers.Spool, data: bytes) -> tuple[int, int]:
        got = real(self, data)
        spilled.append(got[0])
        return got

    monkeypatch.setattr(ociimport.layers, "SPOOL_MEMORY", 50_000)
    monkeypatch.setattr(ociimport.layers.Spool, "add", add)
    other = open_store((tmp_path / "other").as_uri())
    second = oci.import_image(str(tmp_path / "l"), as_ref="small@1", store=other.url)
    assert -1 in spilled and -2 in spilled  # some in memory, the rest in the file
    assert second.layers[0].content_digest == first.layers[0].content_digest
    images.export_image("small@1", tmp_path / "tree", store=other.url)
    assert _tree(tmp_path / "tree") == {**{m.name: ("reg", 0o644, m.data) for m in members},
                                        "srv": ("dir", 0o755, b"")}
