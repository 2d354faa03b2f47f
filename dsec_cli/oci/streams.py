"""The streams an OCI layer blob is read through: hashing readers (the blob's sha256 as it
is read, the uncompressed stream's on a thread of its own), a read-ahead thread that keeps
the next pieces of a blob in memory, and the decompressor a stream's first bytes call for
(gzip with ISA-L, zstd, or none). Each stream is a small file-like object, so the tar
reader on top never sees where its bytes come from."""

from __future__ import annotations

import hashlib
import queue
import tarfile
import threading
from collections.abc import Callable
from typing import IO, Any

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class HashBehind:
    """sha256 on a thread of its own, fed the pieces a reader passes on: hashing the
    uncompressed layer (about a third of inflating it) is taken off the inflating thread,
    which a layer's read waits for. At most ``depth`` pieces wait; the pieces are immutable
    bytes, so nothing is copied."""

    def __init__(self, depth: int = 16) -> None:
        self.q: queue.Queue[bytes | memoryview | None] = queue.Queue(depth)
        self.h = hashlib.sha256()
        self.t = threading.Thread(target=self._run, name="oci-layer-hash", daemon=True)
        self.t.start()
        self.closed = False

    def _run(self) -> None:
        while (piece := self.q.get()) is not None:
            self.h.update(piece)

    def update(self, piece: bytes) -> None:
        self.q.put(piece)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.q.put(None)
            self.t.join()

    def hexdigest(self) -> str:
        self.close()
        return self.h.hexdigest()


class Hashed:
    """A reader that hashes and counts what passes; with ``limit`` it never reads past one
    byte beyond it, so an over-long blob is seen without being read whole. ``h`` is the
    hash (sha256 in this thread by default, or a `HashBehind`)."""

    def __init__(self, f: Any, limit: int | None = None,
                 tick: Callable[[int], None] | None = None, h: Any = None) -> None:
        self.f = f
        self.h: Any = h if h is not None else hashlib.sha256()
        self.n = 0
        self.limit = limit
        self.tick = tick
        self.head = b""

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 20
        if self.head:
            first, self.head = self.head[:n], self.head[n:]
            return first
        if self.limit is not None:
            n = min(n, self.limit + 1 - self.n)
            if n <= 0:
                return b""
        data: bytes = self.f.read(n)
        self.h.update(data)
        self.n += len(data)
        if self.tick and data:
            self.tick(len(data))
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer at the end), left to be read again."""
        head = self.head
        self.head = b""
        while len(head) < n:
            piece = self.read(n - len(head))
            if not piece:
                break
            head += piece
        self.head = head
        return head[:n]

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


class NoHash:
    def update(self, data: bytes) -> None:
        pass


NO_HASH = NoHash()


class Prefetch:
    """Reads a stream on a thread, a bounded queue of pieces ahead of the consumer: the
    thread decompresses and hashes (isal, zstd and sha256 release the GIL) while the caller
    parses, chunks and compresses, so the two overlap on two cores. At most ``depth`` pieces
    wait.

    To the tar reader it is a file that only goes forward: ``read(n)`` returns ``n`` bytes
    unless the stream ends, ``seek`` skips ahead (what tarfile's random-access mode does
    between members) and refuses to go back, so the archive is still read once, as a stream,
    without the per-record copies of tarfile's stream mode.

    Without ``thread`` the pieces are read by the caller as it needs them (a layer read
    lean: the stages then take turns on one thread)."""

    PIECE = 1 << 20

    def __init__(self, f: Any, depth: int = 8, name: str = "oci-layer-read",
                 thread: bool = True) -> None:
        self.f = f
        self.q: queue.Queue[bytes | BaseException] = queue.Queue(depth)
        self.stop = threading.Event()
        self.buf = memoryview(b"")
        self.piece = b""  # what ``buf`` is a view of
        self.eof = False
        self.pos = 0
        self.t: threading.Thread | None = None
        if thread:
            self.t = threading.Thread(target=self._run, name=name, daemon=True)
            self.t.start()

    def _put(self, item: bytes | BaseException) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                data = self.f.read(self.PIECE)
                if not self._put(data) or not data:
                    return
        except BaseException as e:  # handed to the reader, raised there
            self._put(e)

    def _fill(self) -> bool:
        """The next piece in ``buf``; False at the end of the stream."""
        while not self.buf and not self.eof:
            item = self.q.get() if self.t is not None else self.f.read(self.PIECE)
            if isinstance(item, BaseException):
                self.eof = True
                raise item
            if not item:
                self.eof = True
            self.piece = item
            self.buf = memoryview(item)
        return bool(self.buf)

    def read(self, n: int = -1, view: bool = False) -> bytes:
        """``n`` bytes (fewer at the end); with ``view``, bytes held by one piece come as a
        read-only view of it, not a copy (a member's data on its way to the chunker)."""
        if n is None or n < 0:
            n = self.PIECE
        if not self._fill():
            return b""
        if len(self.buf) == n == len(self.piece):  # a whole piece: no copy
            out = self.piece
            self.buf = memoryview(b"")
        elif len(self.buf) >= n:  # the common case: one piece holds it
            out = self.buf[:n] if view else bytes(self.buf[:n])  # type: ignore[assignment]
            self.buf = self.buf[n:]
        else:
            parts = []
            left = n
            while left and self._fill():
                parts.append(self.buf[:left])
                left -= len(parts[-1])
                self.buf = self.buf[len(parts[-1]):]
            out = b"".join(parts)
        self.pos += len(out)
        return out

    def read_some(self, n: int) -> bytes | memoryview:
        """Up to ``n`` bytes, as a read-only view of the one piece that holds them (``b""``
        at the end): what a reader that copies them anyway takes, without joining pieces."""
        if not self._fill():
            return b""
        out = self.buf[:n]
        self.skip(len(out))
        return out

    def block(self, n: int) -> memoryview | None:
        """The next ``n`` bytes as a view of the piece holding them, not taken; None where
        they run past the piece (or the stream). `skip` takes them."""
        if not self._fill() or len(self.buf) < n:
            return None
        return self.buf[:n]

    def skip(self, n: int) -> None:
        """Take ``n`` bytes the current piece holds."""
        self.buf = self.buf[n:]
        self.pos += n

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < self.pos:
            raise tarfile.StreamError("the layer stream cannot go back (a member's data "
                                      "read out of order)")
        while self.pos < offset and self._fill():
            step = min(offset - self.pos, len(self.buf))
            self.buf = self.buf[step:]
            self.pos += step
        return self.pos

    def drain(self) -> None:
        while self._fill():
            self.buf = memoryview(b"")
        if self.t is not None:
            self.t.join()

    def close(self) -> None:
        self.stop.set()
        if self.t is not None:
            self.t.join()


class Inflate:
    """A gzip stream (one member or several, back to back) inflated with ISA-L from large
    pieces of the blob. ISA-L's own streaming decompressor is used, not its zlib-style
    ``decompressobj``: the latter holds the GIL while it inflates, so the layer threads'
    parsing and the inflate took turns instead of running side by side (docs/oci.md,
    "Measured"). Each member's header, CRC and length are checked by ISA-L; bytes after a
    member that do not start another are an error, as in `gzip`. ``read(n)`` returns at most
    ``n`` bytes (``OUT`` without ``n``) whatever the compression ratio (a gzip bomb is read
    piecewise)."""

    PIECE = 1 << 20
    OUT = 4 << 20

    def __init__(self, raw: Hashed) -> None:
        from isal import igzip_lib  # ISA-L's inflate: about 3x zlib's (docs/oci.md)

        self.raw = raw
        self.new = lambda: igzip_lib.IgzipDecompressor(flag=igzip_lib.DECOMP_GZIP)
        self.d = self.new()

    def read(self, n: int = -1) -> bytes:
        limit = n if 0 < n < self.OUT else self.OUT
        while True:
            d = self.d
            if d.eof:
                data = d.unused_data or self.raw.read(self.PIECE)
                if not data:
                    return b""  # the stream ends where a member ends
                self.d = d = self.new()
            elif d.needs_input:
                data = self.raw.read(self.PIECE)
                if not data:
                    raise EOFError("the gzip stream ends inside a member")
            else:  # output left from the input already given
                data = b""
            out: bytes = d.decompress(data, limit)
            if out:
                return out


def decompressed(raw: Hashed) -> IO[bytes]:
    head = raw.peek(4)
    if head[:2] == GZIP_MAGIC:
        return Inflate(raw)  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        import zstandard  # only for zstd layers, the rarer kind

        return zstandard.ZstdDecompressor().stream_reader(  # type: ignore[return-value]
            raw, read_size=Inflate.PIECE, read_across_frames=True)  # type: ignore[arg-type]
    return raw  # type: ignore[return-value]
