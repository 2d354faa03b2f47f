"""The agent protocol's framing (docs/agent.md), read in one place for every client.

A frame is ``u32 length, u8 type, u32 id, payload`` (length counts type, id and payload).
What a sandbox's agent sends is hostile like a store object: `FrameReader` turns the bytes
of a connection into frames without doing any I/O itself, so the threaded and the asyncio
client read through the same code, and a frame whose header claims more than MAX_FRAME is
refused from its header, before a byte of its payload is held.
"""

from __future__ import annotations

import struct

from ...core.errors import SandboxError, UsageError

HEADER = struct.Struct(">IBI")
#: the most a frame may hold, header included, in either direction (the agent's bound too)
MAX_FRAME = 16 << 20


class AgentError(SandboxError):
    """The agent could not be reached or broke the protocol (not a failing command)."""


def frame(kind: int, rid: int, payload: bytes) -> bytes:
    """One frame to send, refused (UsageError) when it would pass MAX_FRAME."""
    if len(payload) + 5 > MAX_FRAME:
        raise UsageError("request too large for one agent frame")
    return HEADER.pack(len(payload) + 5, kind, rid) + payload


class FrameReader:
    """Frames out of one connection's bytes, as they arrive: `feed` what was read, get the
    frames it completed. At most one frame and one read are held."""

    def __init__(self, what: str) -> None:
        self.what = what  # "sandbox <id>": named when the agent breaks the bound
        self._buf = bytearray()

    def feed(self, data: bytes | memoryview) -> list[tuple[int, int, bytes]]:
        """(type, id, payload) of every frame `data` completes; AgentError for a header
        outside the bound (the caller drops the connection)."""
        buf = self._buf
        buf += data
        frames = []
        while len(buf) >= HEADER.size:
            length, kind, rid = HEADER.unpack_from(buf)
            if length < HEADER.size - 4 or length > MAX_FRAME:
                raise AgentError(f"{self.what}'s agent sent a frame of {length} bytes (at most "
                                 f"{MAX_FRAME} are allowed): dropped the connection")
            end = 4 + length
            if len(buf) < end:
                break
            with memoryview(buf) as view:
                frames.append((kind, rid, bytes(view[HEADER.size:end])))
            del buf[:end]
        return frames
