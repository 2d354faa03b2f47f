"""The chunks a store holds (push/dedup.py, `KnownChunks`), in the compiled table
(push/_known.c) and in its Python form: the same answers for every id, the first row of an
id kept, damaged tables refused with nothing added, ids made to collide still told apart,
and a store's tables loaded the same way through either. The extension is compiled here
from its source, so the source in the tree is what is tested whether or not
the package build has built it."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from dsec_cli.push import dedup
from dsec_cli.push.dedup import _REC, KnownChunk, KnownChunks
from dsec_cli.push.stores import open_store
from tests.cext import build_and_load

SRC = Path(dedup.__file__).with_name("_known.c")


@pytest.fixture(scope="module")
def cknown(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return build_and_load(SRC, tmp_path_factory.mktemp("known"))


def _use(monkeypatch: pytest.MonkeyPatch, mod: ModuleType | None) -> None:
    monkeypatch.setattr(dedup, "_known", mod)
    monkeypatch.setattr(dedup, "use_compiled", mod is not None)


def _packs(n: int, tag: int) -> list[str]:
    return [f"{tag:032x}{i:032x}" for i in range(n)]


def _blob(packs: list[str], rows: list[tuple[bytes, int, int, int, int, int]]) -> bytes:
    """A chunk table in its cached form (`dedup._table_blob`)."""
    return (struct.pack("<I", len(packs)) + "".join(packs).encode()
            + b"".join(_REC.pack(*r) for r in rows))


def _tables(rnd: random.Random) -> list[tuple[list[str], list[tuple[bytes, int, int, int,
                                                                      int, int]]]]:
    """Tables sharing ids with each other and within themselves (the first row must win)."""
    pool = [rnd.randbytes(16) for _ in range(3000)]
    out = []
    for t in range(6):
        packs = _packs(rnd.randint(1, 4), t)
        rows = [(rnd.choice(pool), rnd.randrange(len(packs)), rnd.randrange(1 << 40),
                 rnd.randrange(1 << 20), rnd.randrange(1 << 20), rnd.randrange(3))
                for _ in range(rnd.randint(200, 1200))]
        out.append((packs, rows))
    return out


def _expected(tables: list[tuple[list[str], list[tuple[bytes, int, int, int, int, int]]]]
              ) -> dict[bytes, KnownChunk]:
    want: dict[bytes, KnownChunk] = {}
    for packs, rows in tables:
        for cid, p, o, cl, ul, codec in rows:
            want.setdefault(cid, KnownChunk(packs[p], o, cl, ul, codec))
    return want


@pytest.mark.parametrize("compiled", [True, False])
def test_both_forms_answer_every_id_as_a_dict_would(cknown: ModuleType, compiled: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, cknown if compiled else None)
    rnd = random.Random(7)
    tables = _tables(rnd)
    known = KnownChunks()
    assert isinstance(known.table, cknown.Table) == compiled
    for packs, rows in tables:
        assert known.add_table(_blob(packs, rows))
    want = _expected(tables)
    assert known.chunks == want
    for cid, k in want.items():
        assert known.get(cid) == k
    for _ in range(2000):
        assert known.get(rnd.randbytes(16)) is None


def test_compiled_table_grows_and_keeps_first_rows(cknown: ModuleType) -> None:
    """Past many growths of its slots, every id is found, an id added twice keeps its first
    row, and the rows come back in the order they were added."""
    t = cknown.Table(1, 2)
    rnd = random.Random(3)
    ids = [rnd.randbytes(16) for _ in range(200_000)]
    rows = b"".join(_REC.pack(cid, i % 5, i, i + 1, i + 2, i % 3) for i, cid in enumerate(ids))
    assert t.add(rows, 5, 10)
    again = b"".join(_REC.pack(cid, 0, 0, 0, 0, 0) for cid in ids[::7])
    assert t.add(again, 1, 0)
    assert len(t) == len(ids)
    for i in rnd.sample(range(len(ids)), 5000):
        assert t.get(ids[i]) == (i % 5 + 10, i, i + 1, i + 2, i % 3)
    items = t.items()
    assert [x[0] for x in items] == ids
    assert items[12345] == (ids[12345], 12345 % 5 + 10, 12345, 12346, 12347, 12345 % 3)
    with pytest.raises(ValueError, match="16 bytes"):
        t.get(b"short")
    with pytest.raises(RuntimeError, match="already initialized"):
        t.__init__(3, 4)  # new keys would lose every row's slot
    assert t.get(ids[0]) == (10, 0, 1, 2, 0)
    bare = cknown.Table.__new__(cknown.Table)
    with pytest.raises(RuntimeError, match="not initialized"):
        bare.get(ids[0])


def test_ids_made_to_collide_are_still_told_apart(cknown: ModuleType) -> None:
    """Ids equal in either half (what a hostile index could list) each find their own row:
    the slot is a keyed mix of both halves, and a slot's id is compared whole."""
    t = cknown.Table(0xDEADBEEF, 0x12345678)
    same_low = [b"\0" * 8 + i.to_bytes(8, "little") for i in range(3000)]
    same_high = [i.to_bytes(8, "little") + b"\xff" * 8 for i in range(3000)]
    ids = same_low + same_high
    assert t.add(b"".join(_REC.pack(cid, 0, n, 1, 1, 0) for n, cid in enumerate(ids)), 1, 0)
    assert len(t) == len(ids)
    assert all(t.get(cid)[1] == n for n, cid in enumerate(ids))
    assert t.get(b"\0" * 8 + (5000).to_bytes(8, "little")) is None


@pytest.mark.parametrize("compiled", [True, False])
def test_damaged_tables_are_refused_with_nothing_added(cknown: ModuleType, compiled: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, cknown if compiled else None)
    packs = _packs(2, 1)
    good = [(bytes([i]) * 16, i % 2, i, 1, 1, 0) for i in range(10)]
    blob = _blob(packs, good)
    damaged = {
        "a row cut short": blob[:-5],
        "a pack number past the packs": _blob(packs, [*good, (b"x" * 16, 2, 0, 1, 1, 0)]),
        "fewer pack names than counted": struct.pack("<I", 3) + "".join(packs).encode(),
        "a pack count far past the data": struct.pack("<I", 1 << 30) + b"0" * 64,
        "a pack name that is no digest": _blob(["z" * 64], good[:1]),
        "no pack count": b"\1\0",
        "a pack name not text": struct.pack("<I", 1) + b"\xff" * 64,
    }
    for why, data in damaged.items():
        known = KnownChunks()
        assert not known.add_table(data), why
        assert known.chunks == {} and known.packs == [], why
    known = KnownChunks()
    assert known.add_table(blob)
    assert not known.add_table(blob[:-1])  # the good table's rows stay as they were
    assert known.chunks == _expected([(packs, good)])


def test_chunks_written_here_and_packs_dropped(cknown: ModuleType,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of the table keeps where it is over one an index written since names; a
    dropped pack's chunks are not taken, and a chunk written after its pack was dropped is
    taken from where it was written."""
    _use(monkeypatch, cknown)
    from dsec_cli.format.index import ChunkLoc, ChunkParams, LayerIndex

    a, b = bytes([1]) * 16, bytes([2]) * 16
    old, new = _packs(1, 1), _packs(1, 2)
    known = KnownChunks()
    assert known.add_table(_blob(old, [(a, 0, 10, 5, 5, 1)]))
    ix = LayerIndex(entries=[], chunks=[ChunkLoc(a, 0, 99, 5, 5, 1), ChunkLoc(b, 0, 7, 3, 3, 0)],
                    packs=new, params=ChunkParams())
    known.add_index(ix)
    assert known.get(a) == KnownChunk(old[0], 10, 5, 5, 1)
    assert known.get(b) == KnownChunk(new[0], 7, 3, 3, 0)
    known.drop_packs(set(old))
    assert known.get(a) is None and set(known.chunks) == {b}
    known.add_index(ix)
    assert known.get(a) == KnownChunk(new[0], 99, 5, 5, 1)
    known.drop_packs(set(new))
    assert known.get(a) is None and known.get(b) is None and known.chunks == {}


@pytest.mark.parametrize("compiled", [True, False])
def test_a_store_loads_the_same_chunks_either_way(cknown: ModuleType, compiled: bool,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers built into a store: their chunks, loaded from the cached tables and from
    the indexes themselves, in either form, are the indexes' own; with their packs
    excluded, none."""
    from dsec_cli.build.layer import build_layer_from_dir

    rnd = random.Random(11)
    with open_store((tmp_path / "store").as_uri()) as st:
        want: dict[bytes, KnownChunk] = {}
        for name in ("x", "y"):
            src = tmp_path / name
            src.mkdir()
            (src / "big.bin").write_bytes(rnd.randbytes(3 << 20))
            (src / "small.txt").write_bytes(name.encode())
            _, m = build_layer_from_dir(st, src, name, "1", known=KnownChunks())
            ix = dedup.load_index(st, m.index)
            for c in ix.chunks:
                want.setdefault(c.chunk_id, KnownChunk(ix.packs[c.pack], c.offset, c.clen,
                                                       c.ulen, c.codec))
        _use(monkeypatch, cknown if compiled else None)
        monkeypatch.setattr(dedup, "_READ_TABLES", {})
        monkeypatch.setattr(dedup, "_READ_ROWS", 0)
        tables = tmp_path / "tables"
        assert len(want) > 2
        assert KnownChunks.load(st, tables).chunks == want  # the tables written
        assert KnownChunks.load(st, tables).chunks == want  # and read back
        assert KnownChunks.load(st, None).chunks == want
        packs = {k.pack for k in want.values()}
        assert KnownChunks.load(st, tables, exclude_packs=packs).chunks == {}


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_refs_and_manifests_of_a_remote_store_are_read_side_by_side(
        kind: str, make_url: Callable[[str], str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """From S3 the refs and the manifests they reach are read on several threads, from a file
    store in turn; either way the refs, the errors and the chunks are the same, in the same
    order: a ref that does not parse is skipped and reported, a ref whose manifest is gone
    is left out of the chunks with a warning, the others are all there."""
    import threading

    from dsec_cli.core.digests import object_key
    from dsec_cli.format.manifest import Manifest, put_manifest
    from dsec_cli.format.refs import list_refs, set_ref
    from dsec_cli.push.stores.base import Store

    rnd = random.Random(5)
    tables = tmp_path / "tables"
    tables.mkdir()
    want: dict[bytes, KnownChunk] = {}
    with open_store(make_url(kind)) as st:
        for n in range(40):
            index, pack = rnd.randbytes(32).hex(), rnd.randbytes(32).hex()
            rows = [(rnd.randbytes(16), 0, i, 1, 1, 0) for i in range(20)]
            (tables / index).write_bytes(_blob([pack], rows))
            m = Manifest(kind="layer", name=f"l{n % 4}", version=str(n),
                         content_digest=rnd.randbytes(32).hex(), index=index, packs=[pack])
            digest = put_manifest(st, m)
            if n == 17:  # its manifest gone: the ref is left out
                st.delete(object_key("manifests", digest))
            else:
                want.update({r[0]: KnownChunk(pack, *r[2:]) for r in rows})
            set_ref(st, m.name, m.version, digest)
        st.put("refs/l1/bad@name", b"{}")  # not a ref name
        threads: set[str] = set()
        real_get = Store.get

        def get(self: Store, key: str, *a: object, **kw: object) -> bytes:
            threads.add(threading.current_thread().name)
            return real_get(self, key, *a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(Store, "get", get)
        errors: list[object] = []
        refs = list_refs(st, errors)
        assert [r.version for r in refs] == sorted((str(n) for n in range(40)),
                                                   key=lambda v: (f"l{int(v) % 4}", v))
        assert len(errors) == 1 and "bad@name" in caplog.text
        assert KnownChunks.load(st, tables).chunks == want
        assert "ignoring l1@17 for dedup" in caplog.text
        remote = {t for t in threads if t.startswith("store-read")}
        assert bool(remote) == (kind == "s3")
