"""Index entries written as JSON in C (format/_entryjson.c) are byte for byte what the Python
way writes: random entries of every type, with names holding quotes, backslashes, control
characters, non-ASCII and undecodable bytes, with and without chunks, xattrs, device numbers
and integers past 64 bits (those last go through the Python fallback). The extension is
compiled here from its source."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

import pytest

from dsec_cli.format import index
from dsec_cli.format.index import ENTRY_TYPES, Entry, EntryJson, LayerIndex
from tests.cext import build_and_load

SRC = Path(index.__file__).with_name("_entryjson.c")
CHARS = ["a", "/", "é", "漢", '"', "\\", "\n", "\t", "\b", "\f", "\r", "\x01", "\x1f", "\x7f",
         " ", "\u2028", "\udcff", "💥"]


@pytest.fixture(scope="module")
def cjson(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return build_and_load(SRC, tmp_path_factory.mktemp("entryjson"))


def _entries(seed: int, n: int) -> tuple[list[Entry], list[bytes]]:
    rng = random.Random(seed)

    def name() -> str:
        return "".join(rng.choice(CHARS) if rng.random() < 0.3 else rng.choice("abc./_")
                       for _ in range(rng.randint(1, 20)))

    ids = [rng.randbytes(16) for _ in range(64)]
    out = []
    for _ in range(n):
        out.append(Entry(
            name(), rng.choice(ENTRY_TYPES), mode=rng.choice([0o644, 0o755, 0, 0o4755]),
            uid=rng.choice([0, 1000, 2**40]), gid=rng.choice([0, 5, 2**63 + 5]),
            mtime=rng.choice([0, 1_700_000_000_123_456_789, -5]),
            size=rng.choice([0, 1, 123_456, 2**64]),
            target=name() if rng.random() < 0.3 else "",
            rdev=(1, 3) if rng.random() < 0.05 else None,
            xattrs={"user.a": b"\x00\xff"} if rng.random() < 0.05 else {},
            opaque=rng.random() < 0.1,
            chunks=[(rng.randrange(64), rng.randrange(1 << 20), rng.randrange(1, 1 << 20))
                    for _ in range(rng.randint(0, 3))]))
    return out, ids


def _arrays(entries: list[Entry], ids: list[bytes], module: ModuleType | None,
            monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    monkeypatch.setattr(index, "_entryjson", module)
    ej = EntryJson(ids)
    for k in range(0, len(entries), 100):
        ej.add(entries[k:k + 100])
    return ej.arrays()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_c_and_python_write_the_same_bytes(cjson: ModuleType, seed: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    entries, ids = _entries(seed, 2000)
    assert _arrays(entries, ids, cjson, monkeypatch) == \
        _arrays(entries, ids, None, monkeypatch)


def test_the_index_and_its_content_digest_are_unchanged(cjson: ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    entries, ids = _entries(9, 500)
    from dsec_cli.format.index import ChunkLoc

    chunks = [ChunkLoc(cid, 0, n * 10, 10, 10, 1) for n, cid in enumerate(ids)]
    got = []
    for module in (cjson, None):
        monkeypatch.setattr(index, "_entryjson", module)
        ix = LayerIndex(entries=entries, chunks=chunks, packs=["a" * 64])
        got.append((ix.to_bytes(), ix.content_digest()))
    assert got[0] == got[1]


def test_errors_are_raised_not_written(cjson: ModuleType) -> None:
    ids = [bytes(16)]
    with pytest.raises(IndexError):  # a chunk number past the ids: the Python way's error
        cjson.items([Entry("a", "reg", chunks=[(5, 0, 1)])], ids,
                    lambda e: (_ for _ in ()).throw(IndexError("chunk number")))
    with pytest.raises(TypeError, match="two bytes"):
        cjson.items([Entry("r", "chr", rdev=(1, 3))], ids, lambda e: "not bytes")
    with pytest.raises(AttributeError):
        cjson.items([object()], ids, lambda e: (b"", b""))


@pytest.mark.parametrize("with_sha", [False, True])
def test_the_chunk_table_is_the_canonical_json_of_its_rows(with_sha: bool) -> None:
    """The index writes its chunk table row by row; the stored index holds exactly what
    canonical JSON of the rows gives (large offsets, a chunk without a sha256 among ones
    with it), and reads back to the same chunks."""
    import zstandard

    from dsec_cli.format import canonical
    from dsec_cli.format.index import ChunkLoc

    rng = random.Random(11)
    chunks = []
    for i in range(500):
        codec, ulen = rng.choice([0, 1, 2]), rng.randrange(1, 1 << 18)
        chunks.append(ChunkLoc(rng.randbytes(16), rng.randrange(3), rng.randrange(1 << 40),
                               ulen if codec == 0 else rng.randrange(1, 1 << 18), ulen, codec,
                               rng.randbytes(32) if with_sha and i % 7 else None))
    ix = LayerIndex(entries=[Entry(".", "dir", 0o755)], chunks=chunks,
                    packs=[f"{i:064x}" for i in range(3)])
    doc = canonical.loads(zstandard.ZstdDecompressor().decompress(
        ix.to_bytes(), max_output_size=1 << 26), "index")
    want = [[c.chunk_id.hex(), c.pack, c.offset, c.clen, c.ulen, c.codec]
            + ([c.sha256.hex() if c.sha256 else ""] if with_sha else []) for c in chunks]
    assert doc["chunks"] == want and doc["chunk_sha256"] is with_sha
    raw = zstandard.ZstdDecompressor().decompress(ix.to_bytes(), max_output_size=1 << 26)
    assert raw == canonical.dumps(doc)  # the stored bytes are canonical as a whole
    assert LayerIndex.from_bytes(ix.to_bytes()).chunks == chunks
