"""Strict validation of store objects on read: refs, manifests, indexes and pack trailers.

Anyone who can write to a shared store is untrusted, so every object is parsed as hostile
input: each field is checked for its type and range, every cross-reference (chunk numbers,
pack numbers, hardlink targets) must land inside the object, and sizes are bounded by
`core.config.StoreLimits` before anything is allocated for them. A failure raises
`CorruptObjectError` (exit 2) naming the object, its short digest and the field.

These checks run as separate passes over already decoded objects, so the codecs of
`index.py` and `manifest.py` stay plain dataclass mappings (docs/format.md, "Validation").
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Any, NoReturn

import zstandard

from ..core.config import StoreLimits, store_limits
from ..core.digests import parse_ref
from ..core.errors import CorruptObjectError, FormatError, UsageError
from .codec import CODEC_RAW, CODEC_ZGROUP, CODECS, GROUP_MAX
from .layout import ENTRY_TYPES, HEADER, OVERLAY_XATTR_PREFIX, check_rel_path

if TYPE_CHECKING:
    from .index import LayerIndex
    from .manifest import Manifest

log = logging.getLogger(__name__)
_HEX64 = re.compile(r"[0-9a-f]{64}")
U32 = (1 << 32) - 1
I64 = 1 << 63
MAX_PATH = 4096  # PATH_MAX: paths and symlink targets
MAX_XATTR_NAME = 255  # XATTR_NAME_MAX
MAX_XATTR_VALUE = 64 << 10  # XATTR_SIZE_MAX
MAX_XATTRS = 1024  # per entry
MAX_TEXT = 64 << 10  # free-form manifest strings (created_by, env values, annotations)
CAP_XATTR = "security.capability"
#: a file capability the kernel takes from setxattr: its size names its revision
#: (VFS_CAP_REVISION_2 or _3 in magic_etc), which may carry only the effective flag
_CAP_REVISIONS = {20: 0x02000000, 24: 0x03000000}
_CAP_EFFECTIVE = 0x1


def fail(what: str, message: str) -> NoReturn:
    raise CorruptObjectError(f"{what} is corrupt: {message}",
                             hint="`dsec verify` checks every object of a store")


def is_digest(value: object) -> bool:
    return type(value) is str and _HEX64.fullmatch(value) is not None


def check_digest_field(what: str, field: str, value: object) -> str:
    if not is_digest(value):
        fail(what, f"{field} is not a sha256 digest: {_short(value)}")
    return value  # type: ignore[return-value]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(what: str, field: str, value: object, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        fail(what, f"{field} must be an integer in [{lo}, {hi}], not {_short(value)}")
    return value


def check_size(what: str, data: bytes | memoryview, limit: int, setting: str) -> None:
    if len(data) > limit:
        fail(what, f"{len(data)} bytes is more than the limit of {limit} "
                   f"({setting}, docs/format.md)")


def bounded_zstd(data: bytes | memoryview, limit: int, what: str, setting: str) -> bytes:
    """Decompress one zstd frame, refusing (without allocating it) output past `limit`.

    A frame may declare its size, and zstandard's one-shot decompress trusts that
    declaration over any ``max_output_size``; so the declaration is checked first and the
    output is read in bounded pieces."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        fail(what, f"not a zstd frame: {e}")
    if declared > limit:
        fail(what, f"decompresses to {declared} bytes, more than the limit of {limit} "
                   f"({setting})")
    if declared >= 0:  # a declared size within the bound: one allocation of that size
        try:
            return zstandard.ZstdDecompressor().decompress(data)
        except zstandard.ZstdError as e:
            fail(what, f"does not decompress: {e}")
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            while True:
                piece = reader.read(1 << 20)
                if not piece:
                    break
                out += piece
                if len(out) > limit:
                    fail(what, f"decompresses to more than the limit of {limit} bytes "
                               f"({setting})")
    except zstandard.ZstdError as e:
        fail(what, f"does not decompress: {e}")
    return bytes(out)


# -- refs ------------------------------------------------------------------------------------
def validate_ref_doc(doc: Any, what: str) -> tuple[str, float]:
    """(manifest digest, updated) of a decoded ref document."""
    if not isinstance(doc, dict):
        fail(what, "not a JSON object")
    manifest = check_digest_field(what, "manifest", doc.get("manifest"))
    updated = doc.get("updated", 0)
    if type(updated) not in (int, float) or not math.isfinite(updated) or updated < 0:
        fail(what, f"updated must be a non-negative number, not {_short(updated)}")
    return manifest, float(updated)


# -- manifests -------------------------------------------------------------------------------
def _str_map(what: str, field: str, value: object) -> None:
    if not isinstance(value, dict):
        fail(what, f"{field} must be an object of strings")
    for k, v in value.items():
        if type(v) is not str or not k or "\x00" in k or "\x00" in v or len(v) > MAX_TEXT:
            fail(what, f"{field}[{_short(k)}] must be a string without NUL bytes")


def validate_manifest(m: Manifest, what: str) -> Manifest:
    """Types, syntax and cross-field rules of a decoded manifest."""
    if m.kind not in ("layer", "image"):
        fail(what, f"kind must be 'layer' or 'image', not {_short(m.kind)}")
    if type(m.name) is not str or type(m.version) is not str:
        fail(what, "name and version must be strings")
    try:
        parse_ref(f"{m.name}@{m.version}")
    except UsageError:
        fail(what, f"name@version {_short(m.name + '@' + m.version)} is not a valid reference")
    for field in ("packs", "layers", "base"):
        value = getattr(m, field)
        if not isinstance(value, list):
            fail(what, f"{field} must be a list of digests")
        for n, d in enumerate(value):
            check_digest_field(what, f"{field}[{n}]", d)
    if m.kind == "layer":
        check_digest_field(what, "content_digest", m.content_digest)
        check_digest_field(what, "index", m.index)
        if m.layers:
            fail(what, "a layer manifest has no layers")
    else:
        if m.content_digest != "" or m.index is not None or m.packs:
            fail(what, "an image manifest has no content_digest, index or packs")
        if not m.layers:
            fail(what, "an image manifest names at least one layer")
        problem = layer_count_problem(len(m.layers))
        if problem:
            fail(what, problem)
    if m.spec_digest != "" and not is_digest(m.spec_digest):
        fail(what, f"spec_digest is not a sha256 digest: {_short(m.spec_digest)}")
    _str_map(what, "env", m.env)
    _str_map(what, "annotations", m.annotations)
    for field in ("workdir", "created_by"):
        value = getattr(m, field)
        if type(value) is not str or "\x00" in value or len(value) > MAX_TEXT:
            fail(what, f"{field} must be a string without NUL bytes")
    if m.workdir and not m.workdir.startswith("/"):
        fail(what, f"workdir must be an absolute path, not {_short(m.workdir)}")
    for field in ("size", "stored_size", "files"):
        _int(what, field, getattr(m, field), 0, I64 - 1)
    return m


def check_layer(m: Manifest, digest: str, index: LayerIndex) -> str:
    """Compare what a layer manifest declares with the index a reader actually loaded;
    return the verified content digest (the only name a node gives the layer)."""
    what = f"layer manifest {digest[:12]} ({m.ref})" if digest else f"layer manifest {m.ref}"
    actual = index.content_digest()
    if actual != m.content_digest:
        raise CorruptObjectError(
            f"{what} claims content digest {m.content_digest} but its index "
            f"{str(m.index)[:12]} has content digest {actual}; refusing to use it",
            hint="a store writer published a manifest that does not match its index")
    listed = set(m.packs)
    for c in index.chunks:
        if index.packs[c.pack] not in listed:
            fail(what, f"its index uses pack {index.packs[c.pack][:12]}, which packs omits")
    size = files = 0
    for e in index.entries:
        if e.type == "reg":
            size += e.size
        if e.type != "dir":
            files += 1
    if (size, files) != (m.size, m.files):
        fail(what, f"declares size {m.size} and files {m.files}, its index holds "
                   f"{size} bytes in {files} files")
    check_expansion(index, what, size)
    return actual


def stored_bytes(index: LayerIndex) -> int:
    """The pack bytes the files of an index read, each byte once: the union of their
    chunks' ranges (the chunks of a zstd group overlap, all ending where its frame ends)."""
    used = {n for e in index.entries if e.type == "reg" for n, _, _ in e.chunks}
    spans = sorted((c.pack, c.offset, c.offset + c.clen)
                   for n, c in enumerate(index.chunks) if n in used)
    total, pack, end = 0, -1, 0
    for p, start, stop in spans:
        if p != pack:
            pack, end = p, 0
        total += max(0, stop - max(start, end))
        end = max(end, stop)
    return total


def check_expansion(index: LayerIndex, what: str, size: int,
                    limits: StoreLimits | None = None) -> None:
    """A layer may put on disk at most its stored bytes times ``limits.expansion`` (or
    ``limits.expansion_floor``, when more): a file whose chunk list repeats one chunk, or
    files sharing chunks, cannot make a few KiB of store fill a node's disk."""
    lim = limits or store_limits()
    stored = stored_bytes(index)
    bound = max(lim.expansion_floor, stored * lim.expansion)
    if size > bound:
        fail(what, f"its files hold {size} bytes from {stored} stored bytes of chunks, more "
                   f"than the limit of {bound} ({lim.expansion}x, at least "
                   f"{lim.expansion_floor}: limits.expansion, limits.expansion_floor)")


# -- indexes ---------------------------------------------------------------------------------
def validate_index(ix: LayerIndex, what: str, limits: StoreLimits | None = None) -> LayerIndex:
    """Every field and cross-reference of a decoded index (docs/format.md, "Validation")."""
    lim = limits or store_limits()
    packs, chunks, entries = ix.packs, ix.chunks, ix.entries
    for field, value, bound, setting in (
            ("packs", packs, lim.index_packs, "index_packs"),
            ("chunks", chunks, lim.index_chunks, "index_chunks"),
            ("entries", entries, lim.index_entries, "index_entries"),
            ("prefetch", ix.prefetch, lim.index_entries, "index_entries")):
        if not isinstance(value, list):
            fail(what, f"{field} must be a list")
        if len(value) > bound:
            fail(what, f"{len(value)} {field} is more than the limit of {bound} ({setting})")
    for n, pack in enumerate(packs):
        check_digest_field(what, f"packs[{n}]", pack)
    p = ix.params
    for field in ("min_size", "avg_size", "max_size", "small_file"):
        _int(what, f"params.{field}", getattr(p, field), 1, lim.chunk_bytes)
    _int(what, "params.level", p.level, -(1 << 17), 22)
    if not p.min_size <= p.avg_size <= p.max_size:
        fail(what, "params must satisfy min <= avg <= max")
    # a batch chunk of small files ends past the average by less than one small file
    max_chunk = min(max(p.max_size, p.avg_size + p.small_file), lim.chunk_bytes)
    npacks = len(packs)
    for n, c in enumerate(chunks):
        if type(c.chunk_id) is not bytes or len(c.chunk_id) != 16:
            fail(what, f"chunks[{n}]: chunk id is not 16 bytes of xxh3-128")
        pk, off, clen, ulen = c.pack, c.offset, c.clen, c.ulen
        if type(pk) is not int or not 0 <= pk < npacks:
            fail(what, f"chunks[{n}]: pack {_short(pk)} is not one of its {npacks} packs")
        if type(off) is not int or not 0 <= off < I64:
            fail(what, f"chunks[{n}]: offset {_short(off)} is not a non-negative integer")
        if type(ulen) is not int or not 0 <= ulen <= max_chunk:
            fail(what, f"chunks[{n}]: ulen {_short(ulen)} is outside [0, {max_chunk}]")
        if c.codec not in CODECS or type(c.codec) is not int:
            fail(what, f"chunks[{n}]: unknown codec {_short(c.codec)}")
        # a group member's range runs to the end of its group's frame
        max_clen = 2 * GROUP_MAX if c.codec == CODEC_ZGROUP else max_chunk
        if type(clen) is not int or not 0 <= clen <= max_clen:
            fail(what, f"chunks[{n}]: clen {_short(clen)} is outside [0, {max_clen}]")
        if c.codec == CODEC_RAW and clen != ulen:
            fail(what, f"chunks[{n}]: a raw chunk has clen {clen} != ulen {ulen}")
        if c.sha256 is not None and (type(c.sha256) is not bytes or len(c.sha256) != 32):
            fail(what, f"chunks[{n}]: sha256 is not 32 bytes")
    _validate_entries(ix, what, max_chunk)
    for n, path in enumerate(ix.prefetch):
        if type(path) is not str:
            fail(what, f"prefetch[{n}] is not a path")
        try:
            check_rel_path(path)
        except FormatError as e:
            fail(what, f"prefetch[{n}]: {e.message}")
    return ix


def _validate_entries(ix: LayerIndex, what: str, max_chunk: int) -> None:
    chunks = ix.chunks
    nchunks = len(chunks)
    seen: set[str] = set()
    regular: set[str] = set()
    hardlinks: list[tuple[int, str, str]] = []
    # messages are built only on failure: this loop runs once per file of every index read
    for n, e in enumerate(ix.entries):
        path = e.path
        if type(path) is not str or len(path) > MAX_PATH:
            fail(what, f"entries[{n}]: path is not a string of at most {MAX_PATH} characters")
        try:
            check_rel_path(path)
        except FormatError as err:
            fail(what, f"{_at(n, path)}: {err.message}")
        if path in seen:
            fail(what, f"{_at(n, path)}: the path appears twice")
        seen.add(path)
        t = e.type
        if t not in ENTRY_TYPES:
            fail(what, f"{_at(n, path)}: unknown type {_short(t)}")
        if type(e.mode) is not int or not 0 <= e.mode <= 0o7777:
            fail(what, f"{_at(n, path)}: mode {_short(e.mode)} is not within 0o7777")
        if type(e.uid) is not int or not 0 <= e.uid <= U32:
            fail(what, f"{_at(n, path)}: uid {_short(e.uid)} is not a 32-bit unsigned integer")
        if type(e.gid) is not int or not 0 <= e.gid <= U32:
            fail(what, f"{_at(n, path)}: gid {_short(e.gid)} is not a 32-bit unsigned integer")
        if type(e.mtime) is not int or not -I64 <= e.mtime < I64:
            fail(what, f"{_at(n, path)}: mtime {_short(e.mtime)} is not a 64-bit integer")
        if type(e.size) is not int or not 0 <= e.size < I64:
            fail(what, f"{_at(n, path)}: size {_short(e.size)} is not a non-negative integer")
        if type(e.opaque) is not bool or (e.opaque and t != "dir"):
            fail(what, f"{_at(n, path)}: opaque is only true on a directory")
        if t == "reg":
            total = 0
            for k, ext in enumerate(e.chunks):
                if type(ext) is not tuple or len(ext) != 3:
                    fail(what, f"{_at(n, path)}: chunks[{k}] is not [chunk, offset, length]")
                ci, off, ln = ext
                if type(ci) is not int or not 0 <= ci < nchunks:
                    fail(what, f"{_at(n, path)}: chunks[{k}] names chunk {_short(ci)} of {nchunks}")
                if (type(off) is not int or type(ln) is not int or off < 0 or ln < 0
                        or off + ln > chunks[ci].ulen):
                    fail(what, f"{_at(n, path)}: chunks[{k}] range {_short(off)}+{_short(ln)} is "
                               f"outside chunk {ci} ({chunks[ci].ulen} bytes)")
                total += ln
            if total != e.size:
                fail(what, f"{_at(n, path)}: size {e.size} is not the sum of its chunk lengths "
                           f"({total})")
            regular.add(path)
        elif e.chunks:
            fail(what, f"{_at(n, path)}: only a regular file has chunks")
        if t in ("chr", "blk"):
            rd = e.rdev
            if (type(rd) is not tuple or len(rd) != 2 or type(rd[0]) is not int
                    or type(rd[1]) is not int or not 0 <= rd[0] <= U32
                    or not 0 <= rd[1] <= U32):
                fail(what, f"{_at(n, path)}: rdev {_short(rd)} is not [major, minor]")
        elif e.rdev is not None:
            fail(what, f"{_at(n, path)}: only a device has rdev")
        target = e.target
        if type(target) is not str or len(target) > MAX_PATH or "\x00" in target:
            fail(what, f"{_at(n, path)}: target is not a path")
        if t == "sym" and not target:
            fail(what, f"{_at(n, path)}: a symlink has an empty target")
        elif t == "hard":
            hardlinks.append((n, path, target))
        elif t != "sym" and target:
            fail(what, f"{_at(n, path)}: only links have a target")
        if e.xattrs:
            _validate_xattrs(what, _at(n, path), e.xattrs)
    for n, path, target in hardlinks:
        if target not in regular:
            fail(what, f"entries[{n}] ({_short(path)}): hardlink target {_short(target)} is "
                       "not a regular file of the index")


def _at(n: int, path: object) -> str:
    return f"entries[{n}] ({_short(path)})"


def _validate_xattrs(what: str, where: str, xattrs: object) -> None:
    if not isinstance(xattrs, dict) or len(xattrs) > MAX_XATTRS:
        fail(what, f"{where}: xattrs must be an object of at most {MAX_XATTRS} names")
    for k, v in xattrs.items():
        if (type(k) is not str or not k or "\x00" in k
                or len(k.encode("utf-8", "surrogateescape")) > MAX_XATTR_NAME):
            fail(what, f"{where}: xattr name {_short(k)} is not 1-{MAX_XATTR_NAME} bytes")
        if type(v) is not bytes or len(v) > MAX_XATTR_VALUE:
            fail(what, f"{where}: xattr {_short(k)} value is over {MAX_XATTR_VALUE} bytes")
        problem = xattr_problem(k, v)
        if problem:
            fail(what, f"{where}: {problem}")


def xattr_problem(name: str, value: bytes) -> str | None:
    """Why an xattr cannot be part of a layer (docs/format.md, "Entry fields"), or None.

    overlayfs's own names would make a layer's directory opaque, a redirect or a metacopy
    once a node stacks it; a file capability the kernel refuses at setxattr would fail
    every write of the layer, so only the two forms it takes are content."""
    if name.startswith(OVERLAY_XATTR_PREFIX):
        return f"xattr {_short(name)} is overlayfs's own, never part of a layer"
    if name == CAP_XATTR:
        revision = _CAP_REVISIONS.get(len(value))
        magic = int.from_bytes(value[:4], "little")
        if revision is None or magic & ~_CAP_EFFECTIVE != revision:
            return (f"xattr {CAP_XATTR} is not a file capability of revision 2 (20 bytes) "
                    f"or 3 (24 bytes): {len(value)} bytes, magic_etc {value[:4].hex()}")
        if len(value) == 24 and value[20:] == b"\xff\xff\xff\xff":
            return f"xattr {CAP_XATTR} names root uid 4294967295, which is no uid"
    return None


def layer_xattrs(xattrs: dict[str, bytes], where: str) -> dict[str, bytes]:
    """What a layer keeps of the xattrs a source gives a path (an archive member, an image
    layer's member, a scanned file): overlayfs's own names are dropped, as a scan of a tree
    drops them; any other problem is a FormatError naming ``where`` and the xattr."""
    kept = {}
    for name, value in xattrs.items():
        problem = xattr_problem(name, value)
        if problem is None:
            kept[name] = value
        elif name.startswith(OVERLAY_XATTR_PREFIX):
            log.warning("%s: xattr %r dropped (overlayfs's own)", where, name)
        else:
            raise FormatError(f"{where}: {problem}; refused")
    return kept


def layer_count_problem(count: int, limits: StoreLimits | None = None) -> str | None:
    """Why an image of ``count`` layers cannot be stacked by a node, or None."""
    lim = limits or store_limits()
    if count > lim.layers:
        return (f"{count} layers is more than the limit of {lim.layers} (limits.layers; "
                "overlayfs stacks at most 500)")
    return None


# -- packs -----------------------------------------------------------------------------------
def validate_toc(rows: Any, what: str, body_end: int, limits: StoreLimits | None = None
                 ) -> list[tuple[bytes, int, int, int, int]]:
    """The rows of a pack's table of contents: (id, offset, clen, ulen, codec), each chunk
    inside the pack's body (between the header and the trailer)."""
    lim = limits or store_limits()
    if not isinstance(rows, list):
        fail(what, "the table of contents is not a list")
    out = []
    for n, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != 5 or type(r[0]) is not str:
            fail(what, f"toc[{n}] is not [id, offset, clen, ulen, codec]")
        try:
            cid = bytes.fromhex(r[0])
        except ValueError:
            fail(what, f"toc[{n}]: chunk id is not hex")
        if len(cid) != 16:
            fail(what, f"toc[{n}]: chunk id is not 16 bytes")
        off = _int(what, f"toc[{n}].offset", r[1], len(HEADER), body_end)
        clen = _int(what, f"toc[{n}].clen", r[2], 0, body_end - off)
        ulen = _int(what, f"toc[{n}].ulen", r[3], 0, lim.chunk_bytes)
        codec = r[4]
        if type(codec) is not int or codec not in CODECS:
            fail(what, f"toc[{n}]: unknown codec {_short(codec)}")
        out.append((cid, off, clen, ulen, codec))
    return out
