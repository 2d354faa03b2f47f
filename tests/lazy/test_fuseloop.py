"""The compiled FUSE loop (_fuseloop.c, built here from its source as the package build
builds it, warnings as errors) on its own: requests written into a SOCK_SEQPACKET socket
pair (one request per read, as /dev/fuse gives them), replies read back from the peer. What
its tables know is answered there; the rest comes back as the request's bytes; every length
the request claims is checked against what was read."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dsec_cli.run.lazy import fuseproto, kernelfs
from tests.cext import build_and_load

_IN = fuseproto.IN_HEADER
_OUT = fuseproto.OUT_HEADER
SRC = Path(kernelfs.__file__).with_name("_fuseloop.c")


@pytest.fixture(scope="module")
def fuseloop(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return build_and_load(SRC, tmp_path_factory.mktemp("loop"))


@pytest.fixture
def pair(fuseloop: ModuleType) -> Iterator[tuple[Any, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loop = fuseloop.Loop(a.fileno(), 16, 1 << 20)
    yield loop, b
    a.close()
    b.close()


def _req(op: int, unique: int, ino: int, body: bytes = b"", claim: int | None = None) -> bytes:
    n = _IN.size + len(body) if claim is None else claim
    return _IN.pack(n, op, unique, ino, 0, 0, 0, 0, 0) + body


def _read_body(offset: int, size: int) -> bytes:
    return struct.pack("<QQIIQII", 0, offset, size, 0, 0, 0, 0)


def _reply(peer: socket.socket) -> tuple[int, int, bytes]:
    peer.settimeout(30)
    raw = peer.recv(1 << 16)
    ln, err, unique = _OUT.unpack_from(raw)
    assert ln == len(raw)
    return unique, err, raw[_OUT.size:]


def test_known_requests_are_answered_and_the_rest_handed_back(pair: Any) -> None:
    loop, peer = pair
    loop.set_open(3, fuseproto.FOPEN_KEEP_CACHE | fuseproto.FOPEN_NOFLUSH, 0)
    assert loop.set_data(3, b"hello world", False)
    assert not loop.set_data(3, b"other", False)  # set once: readers may hold the first
    peer.send(_req(fuseproto.OPEN, 1, 3, b"\0" * 8))
    peer.send(_req(fuseproto.READ, 2, 3, _read_body(6, 100)))
    peer.send(_req(fuseproto.READ, 3, 3, _read_body(1 << 40, 100)))  # past the end: nothing
    peer.send(_req(fuseproto.RELEASE, 4, 3, b"\0" * 24))
    peer.send(_req(fuseproto.FORGET, 5, 3, b"\0" * 8))  # no reply
    assert loop.set_data(9, b"../target", False)  # a link: its data is its target
    peer.send(_req(fuseproto.READLINK, 7, 9))
    peer.send(_req(fuseproto.OPEN, 6, 4, b"\0" * 8))  # not in the table: handed back
    got = loop.next()
    assert got == _req(fuseproto.OPEN, 6, 4, b"\0" * 8)
    assert _reply(peer) == (1, 0, struct.pack("<QIi", 0, fuseproto.FOPEN_KEEP_CACHE
                                              | fuseproto.FOPEN_NOFLUSH, 0))
    assert _reply(peer) == (2, 0, b"world")
    assert _reply(peer) == (3, 0, b"")
    assert _reply(peer) == (4, 0, b"")
    assert _reply(peer) == (7, 0, b"../target")
    c = loop.counters()
    assert (c["answered"], c["handed"], c["bytes_served"]) == (6, 1, 5)
    assert c["by_op"] == {fuseproto.OPEN: 1, fuseproto.READ: 2, fuseproto.RELEASE: 1,
                          fuseproto.FORGET: 1, fuseproto.READLINK: 1}
    assert c["handed_by_op"] == {fuseproto.OPEN: 1}


def test_lengths_from_the_request_are_checked(pair: Any) -> None:
    loop, peer = pair
    assert loop.set_data(5, b"abc", False)
    # a READ too short to hold its offset and size, a header claiming more than was read,
    # and an inode past the table: all handed back whole, nothing read out of bounds
    short = _req(fuseproto.READ, 1, 5, b"\0" * 8)
    peer.send(short)
    assert loop.next() == short
    liar = _req(fuseproto.LOOKUP, 2, 5, b"x\0", claim=4096)
    peer.send(liar)
    assert loop.next() == liar
    far = _req(fuseproto.READ, 3, 1 << 40, _read_body(0, 10))
    peer.send(far)
    assert loop.next() == far
    peer.send(b"\0" * 10)  # shorter than a header: dropped
    peer.send(_req(fuseproto.READ, 4, 5, _read_body(1, 1)))
    peer.send(_req(fuseproto.STATFS, 5, 1))
    assert loop.next() == _req(fuseproto.STATFS, 5, 1)
    assert _reply(peer) == (4, 0, b"b")
    assert loop.counters()["handed"] == 4


def test_listings_and_lookups_of_a_handed_over_directory(pair: Any) -> None:
    loop, peer = pair
    entry = bytes(range(128))
    loop.set_names(2, [(b"a", entry)])
    recs = [b"R0" * 4, b"R1" * 8, b"R2" * 4]
    loop.set_listing(2, b"".join(recs), [0, 8, 24])
    peer.send(_req(fuseproto.LOOKUP, 1, 2, b"a\0"))
    peer.send(_req(fuseproto.LOOKUP, 2, 2, b"b\0"))  # no such child: a negative entry
    peer.send(_req(fuseproto.READDIRPLUS, 3, 2, _read_body(0, 24)))  # whole records that fit
    peer.send(_req(fuseproto.READDIRPLUS, 4, 2, _read_body(2, 4096)))
    peer.send(_req(fuseproto.READDIRPLUS, 5, 2, _read_body(3, 4096)))  # the end
    peer.send(_req(fuseproto.LOOKUP, 6, 3, b"a\0"))  # a directory not handed over
    assert loop.next() == _req(fuseproto.LOOKUP, 6, 3, b"a\0")
    assert _reply(peer) == (1, 0, entry)
    neg = _reply(peer)
    assert neg[:2] == (2, 0) and struct.unpack_from("<QQQQ", neg[2]) == (0, 0, 86400, 86400)
    assert _reply(peer) == (3, 0, recs[0] + recs[1])
    assert _reply(peer) == (4, 0, recs[2])
    assert _reply(peer) == (5, 0, b"")


def test_a_reported_read_and_several_readers(pair: Any) -> None:
    """A read of a file marked for notice is answered and reported (its inode), once; several
    threads wait in next() at once and each request is answered by one of them."""
    loop, peer = pair
    for ino in range(1, 9):
        assert loop.set_data(ino, bytes([ino]) * 10, ino == 7)
    got: list[Any] = []

    def reader() -> None:
        while (r := loop.next()) is not None:
            got.append(r)
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for n in range(1, 9):
        peer.send(_req(fuseproto.READ, n, n, _read_body(0, 10)))
    peer.send(_req(fuseproto.READ, 9, 7, _read_body(0, 10)))  # read again: not reported
    replies = sorted(_reply(peer) for _ in range(9))
    assert [r[2] for r in replies] == [bytes([n]) * 10 for n in range(1, 9)] + [b"\7" * 10]
    peer.shutdown(socket.SHUT_RDWR)  # the peer gone: every reader returns
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert got == [7]


def test_slices_of_shared_bytes_and_the_budget(pair: Any) -> None:
    """A file is served from a slice of bytes it shares (a chunk), checked against their
    length; what the table holds stays within the budget it was made with."""
    loop, peer = pair
    chunk = b"0123456789"
    assert loop.set_data(1, chunk, False, 2, 3, len(chunk))
    assert loop.set_data(2, chunk, False, 5, 5, 0)  # the same chunk: counted once
    for bad in ((3, chunk, False, 8, 5), (3, chunk, False, -1, 2), (3, chunk, False, 11, 0)):
        with pytest.raises(ValueError):
            loop.set_data(*bad)
    assert not loop.set_data(3, b"x" * (1 << 20), False)  # past the budget: not taken
    assert loop.counters()["inline_bytes"] == len(chunk)
    peer.send(_req(fuseproto.READ, 1, 1, _read_body(0, 100)))
    peer.send(_req(fuseproto.READ, 2, 2, _read_body(1, 100)))
    peer.send(_req(fuseproto.READ, 3, 3, _read_body(0, 100)))  # not taken: handed back
    assert loop.next() == _req(fuseproto.READ, 3, 3, _read_body(0, 100))
    assert _reply(peer) == (1, 0, b"234")
    assert _reply(peer) == (2, 0, b"6789")
