"""The fixed words of the stored format that the codecs and `validate.py` both read: the
entry types of an index, the pack header, overlayfs's xattr names and the rule for a path
inside a tree. A leaf: it imports nothing of the format package, so the codecs import the
validators at module level and the validators never import a codec."""

from __future__ import annotations

from ..core.errors import FormatError

#: the kinds of index entry (docs/format.md, "Index")
ENTRY_TYPES = ("reg", "dir", "sym", "hard", "chr", "blk", "fifo", "whiteout")

#: a pack's first bytes: magic and format version (format/pack.py)
HEADER = b"DSECPK\x00\x01"

#: xattrs overlayfs keeps for itself: never stored from a scanned tree, never written back
OVERLAY_XATTR_PREFIX = "trusted.overlay."
OPAQUE_XATTR = "trusted.overlay.opaque"


def check_rel_path(path: str) -> str:
    """A normalized relative path inside a tree, or FormatError."""
    if path == ".":
        return path
    if not path or path.startswith("/") or "\x00" in path:
        raise FormatError(f"invalid path in tree: {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise FormatError(f"path escapes or is not normalized: {path!r}")
    return path
