"""The compiled tar header decoder (build/_tarhdr.c) reads every member exactly as tarfile's
own parser does: the same attributes, offsets, pax headers and sparse maps, the same errors
for damaged headers, and byte-identical imported layers, hostile entries included. The
extension is compiled here from its source, so the source in the tree is what is tested
whether or not the package build has built it."""

from __future__ import annotations

import io
import random
import subprocess
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dsec_cli.api import images, oci
from dsec_cli.build import tarhdr
from dsec_cli.oci import streams
from tests.cext import build_and_load

from .helpers import Image, base_image, device, directory, file, hardlink, symlink, write_layout

SRC = Path(tarhdr.__file__).with_name("_tarhdr.c")


@pytest.fixture(scope="module")
def ctarhdr(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return build_and_load(SRC, tmp_path_factory.mktemp("tarhdr"))


def _use(monkeypatch: pytest.MonkeyPatch, mod: ModuleType | None) -> None:
    monkeypatch.setattr(tarhdr, "_tarhdr", mod)
    monkeypatch.setattr(tarhdr, "use_compiled", mod is not None)


def _info(ti: tarfile.TarInfo, name: str, **kw: Any) -> tarfile.TarInfo:
    ti.name = name
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def _tarballs() -> dict[str, bytes]:
    """Archives in every header form tarfile writes, with hostile and odd members."""
    out = {}
    for fmt, fname in ((tarfile.PAX_FORMAT, "pax"), (tarfile.GNU_FORMAT, "gnu"),
                       (tarfile.USTAR_FORMAT, "ustar")):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            def add(ti: tarfile.TarInfo, data: bytes = b"") -> None:
                ti.size = len(data) if ti.isreg() else 0
                tf.addfile(ti, io.BytesIO(data) if ti.isreg() else None)

            add(_info(tarfile.TarInfo(), "etc", type=tarfile.DIRTYPE, mode=0o755))
            add(_info(tarfile.TarInfo(), "etc/hostname", mtime=1_700_000_000), b"box\n")
            add(_info(tarfile.TarInfo(), "../escape"), b"x")
            add(_info(tarfile.TarInfo(), "/etc/abs"), b"x")
            add(_info(tarfile.TarInfo(), "out", type=tarfile.SYMTYPE, linkname="../../etc"))
            add(_info(tarfile.TarInfo(), "lnk", type=tarfile.SYMTYPE, linkname="/etc"))
            add(_info(tarfile.TarInfo(), "lnk/passwd"), b"root::0:0::/:/bin/sh")
            add(_info(tarfile.TarInfo(), "h", type=tarfile.LNKTYPE, linkname="../../x"))
            add(_info(tarfile.TarInfo(), "mem", type=tarfile.CHRTYPE, devmajor=1,
                      devminor=1))
            add(_info(tarfile.TarInfo(), "blk", type=tarfile.BLKTYPE, devmajor=8))
            add(_info(tarfile.TarInfo(), "fifo", type=tarfile.FIFOTYPE))
            add(_info(tarfile.TarInfo(), "d/.wh..wh..opq"), b"")
            if fmt != tarfile.USTAR_FORMAT:  # names longer than ustar's fields
                add(_info(tarfile.TarInfo(), "a/" + "long-" * 40 + "name"), b"long")
                add(_info(tarfile.TarInfo(), "b/" + "x" * 120, type=tarfile.SYMTYPE,
                          linkname="t" * 120))
            add(_info(tarfile.TarInfo(), "owner", uid=123456, gid=654321, uname="u" * 31,
                      gname="g"), b"o")
            add(_info(tarfile.TarInfo(), "caf\xe9 \u2603"), b"utf8")
            if fmt != tarfile.USTAR_FORMAT:  # numbers too large for octal fields
                add(_info(tarfile.TarInfo(), "bigid", uid=1 << 40, mtime=-5), b"b")
        out[fname] = buf.getvalue()
    # a V7 directory (a regular-file type with a trailing slash), and a ustar prefix split
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        tf.addfile(_info(tarfile.TarInfo(), "v7dir/", type=tarfile.AREGTYPE))
        tf.addfile(_info(tarfile.TarInfo(), "p" * 90 + "/" + "q" * 90))
    out["v7-prefix"] = buf.getvalue()
    # a global pax header in force for the members after it
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT,
                      pax_headers={"mtime": "1700000000.5", "uid": "77"}) as tf:
        tf.addfile(_info(tarfile.TarInfo(), "g/file", size=3), io.BytesIO(b"abc"))
        tf.addfile(_info(tarfile.TarInfo(), "g/dir", type=tarfile.DIRTYPE))
    out["pax-global"] = buf.getvalue()
    return out


def _members(data: bytes, cls: type[tarfile.TarInfo]) -> list[Any]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=cls) as tf:
        return [(m.get_info(), m.chksum, m.offset, m.offset_data, m.pax_headers, m.sparse,
                 m.path) for m in tf]


def _stream_members(data: bytes, piece: int, read_data: bool) -> list[Any]:
    """Members as `StreamTarFile` reads them from a layer stream cut into ``piece``-byte
    pieces (headers and data then straddle pieces), each member's data read or skipped."""
    ahead = streams.Prefetch(io.BytesIO(data), thread=False)
    ahead.PIECE = piece
    out = []
    with tarhdr.StreamTarFile.open(fileobj=ahead, mode="r:",  # type: ignore[call-overload]
                                   tarinfo=tarhdr.tarinfo_class()) as tf:
        for m in tf:
            out.append((m.get_info(), m.chksum, m.offset, m.offset_data, m.pax_headers,
                        m.sparse, m.path))
            if read_data and m.isreg() and not m.sparse and m.size:
                ahead.seek(m.offset_data)
                assert len(ahead.read(m.size)) == m.size
    return out


def _outcome(data: bytes, cls: type[tarfile.TarInfo] | None,
             piece: int = 1 << 20) -> Any:
    """The members, or the error's type; ``cls`` None reads through `StreamTarFile`."""
    try:
        if cls is None:
            return _stream_members(data, piece, False)
        return _members(data, cls)
    except (tarfile.TarError, UnicodeError) as e:
        return type(e).__name__


@pytest.mark.parametrize("name", list(_tarballs()))
def test_members_read_as_tarfile_reads_them(name: str, ctarhdr: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    data = _tarballs()[name]
    _use(monkeypatch, ctarhdr)
    fast = _members(data, tarhdr.tarinfo_class())
    assert tarhdr.tarinfo_class() is not tarfile.TarInfo
    assert fast == _members(data, tarfile.TarInfo)
    assert len(fast) >= 2


@pytest.mark.parametrize("name", list(_tarballs()))
def test_stream_reads_members_as_tarfile_reads_them(name: str, ctarhdr: ModuleType,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`StreamTarFile` (plain members in one step, the rest through tarfile) gives
    tarfile's members and offsets, whether a header lies in one piece of the stream or
    across two, and whether each member's data is read or skipped."""
    data = _tarballs()[name]
    _use(monkeypatch, ctarhdr)
    want = _members(data, tarfile.TarInfo)
    for piece in (1 << 20, 700, 512, 1000):
        for read_data in (False, True):
            assert _stream_members(data, piece, read_data) == want, (piece, read_data)
    _use(monkeypatch, None)  # without the compiled decoder: tarfile's next for all
    assert _stream_members(data, 700, True) == want


def test_stream_takes_plain_members_in_one_step(ctarhdr: ModuleType,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain members do not go through tarfile's own next; a global pax header sends every
    member after it there."""
    _use(monkeypatch, ctarhdr)
    calls = []
    real = tarfile.TarFile.next

    def counted(self: tarfile.TarFile) -> tarfile.TarInfo | None:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(tarfile.TarFile, "next", counted)
    assert len(_stream_members(_tarballs()["ustar"], 1 << 20, True)) == 14
    assert len(calls) <= 2  # the first member (opening reads it) and the end
    calls.clear()
    assert len(_stream_members(_tarballs()["pax-global"], 1 << 20, True)) == 2
    assert len(calls) >= 3


def test_stream_cut_short_fails_as_tarfile_fails(ctarhdr: ModuleType,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An archive cut anywhere (in a header, in a member's data) gives tarfile's members,
    or its error."""
    _use(monkeypatch, ctarhdr)
    data = _tarballs()["gnu"]
    for end in range(0, len(data), 97):
        cut = data[:end]
        assert _outcome(cut, None, 700) == _outcome(cut, tarfile.TarInfo), end


def test_sparse_members_read_as_tarfile_reads_them(tmp_path: Path, ctarhdr: ModuleType,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU tar's sparse forms (the old header, pax 0.0/0.1 and 1.0) go to tarfile's own
    parser and come out the same."""
    f = tmp_path / "holes"
    with open(f, "wb") as out:
        out.seek(1 << 20)
        out.write(b"data")
        out.seek(3 << 20)
        out.write(b"end")
    _use(monkeypatch, ctarhdr)
    for fmt in ("gnu", "posix"):
        arc = tmp_path / f"{fmt}.tar"
        subprocess.run(["tar", "--sparse", f"--format={fmt}", "-cf", str(arc), "-C",
                        str(tmp_path), "holes"], check=True)
        data = arc.read_bytes()
        fast = _members(data, tarhdr.tarinfo_class())
        assert fast == _members(data, tarfile.TarInfo)
        assert any(m[5] for m in fast) or fmt == "posix"


def test_damaged_headers_fail_as_tarfile_fails(ctarhdr: ModuleType,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes of the header blocks changed at random (checksums fixed up half the time so
    the fields themselves are read): the same members, or the same error."""
    _use(monkeypatch, ctarhdr)
    rng = random.Random(1234)
    sources = list(_tarballs().values())
    fields = [(100, 8), (108, 8), (124, 12), (136, 12), (148, 8), (156, 1), (329, 8),
              (0, 100), (345, 155)]
    for n in range(600):
        data = bytearray(rng.choice(sources))
        block = rng.randrange(min(8, len(data) // 512)) * 512
        start, length = rng.choice(fields)
        for _ in range(rng.randint(1, 3)):
            data[block + start + rng.randrange(length)] = rng.choice(
                b"0017 \x00\x80\xff\t+-_x9\xe9/")
        if n % 2:
            head = data[block:block + 512]
            head[148:156] = b" " * 8
            data[block + 148:block + 156] = b"%06o\x00 " % (sum(head) & 0o777777)
        got = _outcome(bytes(data), tarhdr.tarinfo_class())
        assert got == _outcome(bytes(data), tarfile.TarInfo), (n, block, start)
        assert _outcome(bytes(data), None, 700) == got, (n, block, start)


@pytest.mark.parametrize("members", [
    base_image().layers[0],
    [file("../escape", b"x")],
    [symlink("etc", "/etc"), file("etc/passwd", b"root::0:0::/:/bin/sh")],
    [hardlink("h", "etc/shadow")],
    [directory("d"), device("d/mem", 1, 1), device("d/gone", 0, 0), file("d/.wh.x", b"")],
    [symlink("out", "../../../../etc")],
], ids=["base", "dotdot", "write-through-symlink", "hardlink-outside", "devices",
        "symlink-out"])
def test_imports_are_identical_with_either_parser(members: list[Any], env: dict[str, str],
                                                  tmp_path: Path, ctarhdr: ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The same layer (content digest, entries) or the same refusal, with the compiled
    decoder and with tarfile's parser alone."""
    write_layout(Image([members]), tmp_path / "img")
    got = []
    for n, mod in enumerate((ctarhdr, None)):
        _use(monkeypatch, mod)
        monkeypatch.setenv("DSEC_STORE", (tmp_path / f"store{n}").as_uri())
        try:
            report = oci.import_image(str(tmp_path / "img"), as_ref="img@1")
        except Exception as e:
            got.append((type(e).__name__, str(e)))
            continue
        layer = report.layers[0]
        got.append((layer.content_digest, layer.manifest,
                    images.inspect(layer.ref, files=True)["files"]))
    assert got[0] == got[1]
