"""Chunk groups (codec 2, format/codec.py): new chunks are compressed in groups sharing one
zstd frame. Layers round-trip, a chunk is still read with one ranged read, a store written
in format 1 (before groups) still reads, verifies, transfers and is collected, repack copies a
group once, and a damaged or hostile group is refused with an error naming it."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from dsec_cli.build import layer
from dsec_cli.build.layer import build_layer_from_dir
from dsec_cli.core.digests import object_key
from dsec_cli.core.errors import CorruptObjectError, FormatError, IntegrityError
from dsec_cli.format import canonical
from dsec_cli.format.codec import (
    CODEC_ZGROUP,
    GROUP_MAX,
    MEMBER,
    decode,
    decode_group,
    encode_group,
)
from dsec_cli.format.index import LayerIndex
from dsec_cli.format.manifest import load_manifest
from dsec_cli.format.pack import read_toc
from dsec_cli.format.reader import ChunkReader
from dsec_cli.format.refs import delete_ref, resolve
from dsec_cli.push.dedup import KnownChunks, load_index
from dsec_cli.push.gc import gc_store
from dsec_cli.push.materialize import export
from dsec_cli.push.repack import repack
from dsec_cli.push.stores import Store, open_store
from dsec_cli.push.transfer import copy_refs
from dsec_cli.push.verify import verify

from ..treecmp import assert_same_tree

V1_STORE = Path(__file__).parent / "data" / "store-v1"


def v1_tree(src: Path) -> Path:
    """The tree the format-1 store in data/store-v1 was built from (by dsec before chunk
    groups, with `build_layer_from_dir(store, src, "old", "1")`)."""
    rnd = random.Random(7)
    (src / "small").mkdir(parents=True)
    for i in range(30):
        (src / f"small/f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 3))
    (src / "text.log").write_text("".join(f"event {i} ok\n" for i in range(30_000)))
    (src / "random.bin").write_bytes(rnd.randbytes(40_000))
    os.symlink("text.log", src / "link")
    for p in sorted(src.rglob("*"), reverse=True):
        os.utime(p, ns=(1_600_000_000_000_000_000,) * 2, follow_symlinks=False)
    return src


def similar_tree(src: Path, files: int = 60, seed: int = 3) -> Path:
    """Files that are versions of one another (a shared header and body, a few lines of
    each changed), as in a library of related environments: each compresses far better
    next to the others than alone."""
    rnd = random.Random(seed)
    words = [f"{rnd.choice(['get', 'set', 'make', 'load'])}_{n}" for n in range(400)]
    header = "".join(f"# {' '.join(rnd.choices(words, k=8))}\n" for _ in range(40))
    base = [f"def {rnd.choice(words)}(self, {rnd.choice(words)}):\n"
            f"    return self.{rnd.choice(words)} + {rnd.randrange(1000)}\n"
            for _ in range(300)]
    for i in range(files):
        body = list(base)
        for _ in range(5):
            body[rnd.randrange(len(body))] = f"    x = {rnd.randrange(10**9)}\n"
        p = src / f"pkg{i % 4}" / f"mod{i:03d}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(header + f"# module {i}\n" + "".join(body))
    (src / "noise.bin").write_bytes(rnd.randbytes(70_000))  # incompressible: stored raw
    return src


def _index(store: Store, ref: str) -> LayerIndex:
    return load_index(store, load_manifest(store, resolve(store, ref)).index or "")


def _stored_format(ix: LayerIndex) -> int:
    import zstandard

    raw = zstandard.ZstdDecompressor().decompressobj().decompress(ix.to_bytes())
    return int(canonical.loads(raw, "index")["format"])


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "store"))


@pytest.fixture
def v1_store(tmp_path: Path) -> Store:
    shutil.copytree(V1_STORE, tmp_path / "v1")
    return open_store(str(tmp_path / "v1"))


def test_groups_round_trip_and_are_smaller(tmp_path: Path, store: Store,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = similar_tree(tmp_path / "src")
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    ix = _index(store, "lib@1")
    assert any(c.codec == CODEC_ZGROUP for c in ix.chunks)
    assert _stored_format(ix) == 2
    export(store, "lib@1", tmp_path / "out")
    assert_same_tree(src, tmp_path / "out")
    grouped = load_manifest(store, resolve(store, "lib@1"))

    monkeypatch.setattr(layer, "GROUP_CHUNKS", 1)  # one frame per chunk, as format 1 did
    alone_store = open_store(str(tmp_path / "alone"))
    build_layer_from_dir(alone_store, src, "lib", "1", known=KnownChunks())
    alone = load_manifest(alone_store, resolve(alone_store, "lib@1"))
    assert alone.content_digest == grouped.content_digest  # the same layer
    assert grouped.stored_size < 0.9 * alone.stored_size
    # stored_size counts a group's frame once (members' ranges overlap)
    packs = sum((tmp_path / "store" / object_key("packs", p)).stat().st_size
                for p in grouped.packs)
    assert grouped.stored_size <= packs
    # an index without groups stays format 1, readable by dsec before groups
    assert all(c.codec != CODEC_ZGROUP for c in _index(alone_store, "lib@1").chunks)
    assert _stored_format(_index(alone_store, "lib@1")) == 1


def test_one_member_is_read_with_one_ranged_read(tmp_path: Path, store: Store) -> None:
    src = similar_tree(tmp_path / "src")
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    ix = _index(store, "lib@1")
    e = next(e for e in ix.entries if e.chunks and ix.chunks[e.chunks[0][0]].codec == 2)
    calls: list[tuple[str, int, int]] = []

    def fetch(pack: str, off: int, length: int) -> bytes:
        calls.append((pack, off, length))
        with open(tmp_path / "store" / object_key("packs", pack), "rb") as f:
            f.seek(off)
            return f.read(length)

    got = b"".join(ChunkReader(ix, fetch).read_file(e))
    assert got == (src / e.path).read_bytes()
    assert len(calls) == 1
    # several members of a group asked together: one read and one decompression per group
    calls.clear()
    members = [i for i, c in enumerate(ix.chunks) if c.codec == CODEC_ZGROUP]
    reader = ChunkReader(ix, fetch, max_read=64 << 20)
    for i, data in reader.chunks(members):
        assert data and len(data) == ix.chunks[i].ulen
    groups = {(ix.chunks[i].pack, ix.chunks[i].offset + ix.chunks[i].clen) for i in members}
    assert len(groups) < len(members)
    assert len(calls) <= len(groups)


def test_format_1_store_still_reads_verifies_transfers_and_collects(
        tmp_path: Path, v1_store: Store) -> None:
    want = v1_tree(tmp_path / "src")
    ix = _index(v1_store, "old@1")
    assert {c.codec for c in ix.chunks} <= {0, 1} and ix.chunks
    export(v1_store, "old@1", tmp_path / "out")
    assert_same_tree(want, tmp_path / "out", root_meta=False)
    assert not verify(v1_store, deep=True).problems

    # a new layer over the old store reuses its chunks and reads from both formats
    both = tmp_path / "both"
    shutil.copytree(want, both)
    similar_tree(both / "new")
    build_layer_from_dir(v1_store, both, "mixed", "1")
    mixed = _index(v1_store, "mixed@1")
    assert {c.codec for c in mixed.chunks} >= {1, CODEC_ZGROUP}
    old_ids = {c.chunk_id for c in ix.chunks}
    assert old_ids <= {c.chunk_id for c in mixed.chunks}
    assert not verify(v1_store, deep=True).problems

    dst = open_store(str(tmp_path / "dst"))
    copy_refs(v1_store, dst, ["old@1", "mixed@1"])
    export(dst, "mixed@1", tmp_path / "out2")
    assert_same_tree(both, tmp_path / "out2", root_meta=False)
    assert not verify(dst, deep=True).problems

    # gc keeps what a ref reaches in either format and drops the rest
    delete_ref(v1_store, "old@1")
    gc_store(v1_store, grace=0)
    gc_store(v1_store, grace=0)
    export(v1_store, "mixed@1", tmp_path / "out3")
    assert_same_tree(both, tmp_path / "out3", root_meta=False)
    assert not verify(v1_store, deep=True).problems


def test_repack_copies_a_group_once(tmp_path: Path, store: Store) -> None:
    src = similar_tree(tmp_path / "src", files=40)
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    # v2 keeps a third of the files: most chunks of v1's groups die with v1's ref
    for p in sorted(src.rglob("*.py"))[::3]:
        p.unlink()
    (src / "noise.bin").unlink()
    build_layer_from_dir(store, src, "lib", "2")
    delete_ref(store, "lib@1")
    m = load_manifest(store, resolve(store, "lib@2"))
    size = sum((tmp_path / "store" / object_key("packs", p)).stat().st_size for p in m.packs)
    # gc counts the bytes a group's members share once: the dead part of the pack shows
    usage = gc_store(store, grace=3600, dry_run=True, repack_threshold=0.0, repack=False)
    cands = {c["pack"]: c for c in usage.repack_candidates}
    assert set(m.packs) <= set(cands)
    assert all(0 < cands[p]["live_bytes"] < cands[p]["size"] for p in m.packs)
    report = repack(store, set(m.packs))
    assert report.packs_written and report.bytes_copied <= size
    export(store, "lib@2", tmp_path / "out")
    assert_same_tree(src, tmp_path / "out", root_meta=False)
    assert not verify(store, deep=True).problems
    for p in report.packs_written:
        toc = read_toc(store.get(object_key("packs", p)))
        assert any(c.codec == CODEC_ZGROUP for c in toc)


def test_corrupt_group_is_refused_naming_the_chunk(tmp_path: Path, store: Store) -> None:
    src = similar_tree(tmp_path / "src")
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    ix = _index(store, "lib@1")
    c = next(c for c in ix.chunks if c.codec == CODEC_ZGROUP)
    path = tmp_path / "store" / object_key("packs", ix.packs[c.pack])
    data = bytearray(path.read_bytes())
    data[c.offset + c.clen - 40] ^= 0xFF  # inside the group's frame
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as e:
        export(store, "lib@1", tmp_path / "out")
    assert e.value.exit_code == 2
    assert "is corrupt" in e.value.message or "pack" in e.value.message
    problems = verify(store, deep=True).problems
    assert problems and any(p.kind in ("pack", "chunk") for p in problems)


def test_hostile_member_headers_are_refused_before_any_large_allocation() -> None:
    blob, rows = encode_group([b"a" * 5000, b"b" * 5000, b"c" * 5000], 3)
    assert [r[0] for r in rows] == [CODEC_ZGROUP] * 3
    # a set larger than readers accept is stored chunk by chunk
    big = [os.urandom(16) * (GROUP_MAX // 32 + 1)] * 2
    assert [r[0] for r in encode_group(big, 1)[1]] == [1, 1]
    _, off, clen = rows[1]
    good = blob[off:off + clen]
    assert decode(CODEC_ZGROUP, good, 5000) == b"b" * 5000
    # a member that claims to sit past GROUP_MAX in its group
    far = MEMBER.pack(GROUP_MAX, 1) + good[MEMBER.size:]
    with pytest.raises(IntegrityError, match="past the limit"):
        decode(CODEC_ZGROUP, far, 5000)
    # more headers than there are bytes
    with pytest.raises(IntegrityError, match="more headers"):
        decode(CODEC_ZGROUP, MEMBER.pack(0, 1 << 30) + good[MEMBER.size:], 5000)
    with pytest.raises(IntegrityError, match="no header"):
        decode(CODEC_ZGROUP, b"abc", 3)
    # a member reaching past the group's end
    with pytest.raises(IntegrityError, match="ends after"):
        decode(CODEC_ZGROUP, MEMBER.pack(14_000, 1) + good[MEMBER.size:], 5000)
    # a frame asking for a window above the reader's bound
    import zstandard

    cobj = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=27)).compressobj()  # streamed: the size is unknown, the window stays
    huge = cobj.compress(os.urandom(64) * 1000) + cobj.flush()
    with pytest.raises(IntegrityError, match="decompress"):
        decode_group(MEMBER.pack(0, 0) + huge, [1000])


def test_validator_bounds_group_ranges_and_refuses_unknown_formats(tmp_path: Path,
                                                                   store: Store) -> None:
    src = similar_tree(tmp_path / "src", files=8)
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    ix = _index(store, "lib@1")
    import zstandard

    doc = canonical.loads(zstandard.ZstdDecompressor().decompressobj().decompress(
        ix.to_bytes()), "index")
    n = next(i for i, c in enumerate(doc["chunks"]) if c[5] == CODEC_ZGROUP)
    bad = dict(doc, chunks=[list(c) for c in doc["chunks"]])
    bad["chunks"][n][3] = 2 * GROUP_MAX + 1
    with pytest.raises(CorruptObjectError, match=r"clen .* is outside"):
        LayerIndex.from_bytes(zstandard.ZstdCompressor().compress(canonical.dumps(bad)))
    newer = dict(doc, format=3)
    with pytest.raises(FormatError, match="upgrade dsec") as e:
        LayerIndex.from_bytes(zstandard.ZstdCompressor().compress(canonical.dumps(newer)))
    assert e.value.exit_code == 2


def test_lazy_reads_of_a_grouped_layer(tmp_path: Path, store: Store) -> None:
    """The lazy loader's source (run/lazy) reads group members at any offset, verified."""
    from dsec_cli.run.lazy.cache import ChunkCache
    from dsec_cli.run.lazy.source import Fetcher, LayerSource

    src = similar_tree(tmp_path / "src")
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    ix = _index(store, "lib@1")
    assert any(c.codec == CODEC_ZGROUP for c in ix.chunks)

    def fetch(pack: str, off: int, length: int) -> bytes:
        with open(tmp_path / "store" / object_key("packs", pack), "rb") as f:
            f.seek(off)
            return f.read(length)

    source = LayerSource(ix, Fetcher(fetch, ChunkCache(tmp_path / "cache", 1 << 30),
                                     max_read=4 << 20))
    rnd = random.Random(5)
    for e in ix.entries:
        if not e.chunks:
            continue
        want = (src / e.path).read_bytes()
        off = rnd.randrange(len(want))
        assert source.read(e, off, 5000) == want[off:off + 5000]
        assert source.read(e, 0, e.size) == want


def test_lazy_reading_every_file_of_a_grouped_layer_fetches_each_group_once(
        tmp_path: Path, store: Store) -> None:
    """A file's chunk sits in a group with its neighbours' (one range holds them all): the
    first read of any member fetches and decodes the whole group, so reading every file,
    one file at a time and without read-ahead, fetches no more than the packs hold."""
    from dsec_cli.run.lazy.cache import ChunkCache
    from dsec_cli.run.lazy.source import Fetcher, LayerSource

    src = similar_tree(tmp_path / "src")
    build_layer_from_dir(store, src, "lib", "1", known=KnownChunks())
    ix = _index(store, "lib@1")
    groups = {(c.pack, c.offset + c.clen) for c in ix.chunks if c.codec == CODEC_ZGROUP}
    assert len(groups) >= 2

    def fetch(pack: str, off: int, length: int) -> bytes:
        with open(tmp_path / "store" / object_key("packs", pack), "rb") as f:
            f.seek(off)
            return f.read(length)

    fetcher = Fetcher(fetch, ChunkCache(tmp_path / "cache", 1 << 30), max_read=4 << 20)
    source = LayerSource(ix, fetcher)
    for e in ix.entries:
        if e.chunks:
            assert source.read(e, 0, e.size) == (src / e.path).read_bytes()
    stored = sum((tmp_path / "store" / object_key("packs", p)).stat().st_size
                 for p in ix.packs)
    assert 0 < fetcher.stats.bytes_fetched <= stored


def test_entry_json_slices_give_the_whole_index_bytes() -> None:
    """The layer writer serializes entries a slice at a time (index.EntryJson) and splices
    the arrays into the index (canonical.dumps_with): the same bytes and content digest as
    an index made from the entries in one go, for any slicing, names that are not UTF-8
    and entries without chunks included."""
    from dsec_cli.format import canonical
    from dsec_cli.format.index import ChunkLoc, Entry, EntryJson, LayerIndex

    ids = [bytes([i]) * 16 for i in range(5)]
    chunks = [ChunkLoc(cid, 0, 10 * i, 10, 20, 1) for i, cid in enumerate(ids)]
    entries = [Entry(".", "dir", 0o755), Entry("a", "reg", size=20, chunks=[(0, 0, 20)]),
               Entry("b\udcff", "sym", target="t\udcfe"), Entry("c", "reg", size=0),
               Entry("d", "reg", size=45, xattrs={"user.x": b"\x00"},
                     chunks=[(1, 0, 20), (4, 0, 20), (2, 5, 5)]),
               Entry("e", "whiteout", mode=0), Entry("é", "hard", target="a")]
    whole = LayerIndex(entries=entries, chunks=chunks, packs=["ab" * 32])
    for cut in ([], [1], [2, 3], [1, 2, 3, 4, 5, 6]):
        ej = EntryJson(ids)
        for lo, hi in zip([0, *cut], [*cut, len(entries)], strict=True):
            ej.add(entries[lo:hi])
        sliced = LayerIndex(entries=entries, chunks=chunks, packs=["ab" * 32],
                            entry_json=ej.arrays())
        assert sliced.to_bytes() == whole.to_bytes()
        assert sliced.content_digest() == whole.content_digest()
    assert LayerIndex.from_bytes(whole.to_bytes()).entries == entries
    doc = {"b": [1, "é"], "a": {"z": 1, "y": None}, "c": "x"}
    assert canonical.dumps_with({k: v for k, v in doc.items() if k != "b"},
                                {"b": canonical.dumps(doc["b"])}) == canonical.dumps(doc)
