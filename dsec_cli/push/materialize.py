"""Writing layers out of a store: exports (a directory or a tar of an image's merged tree) and
the node's layer cache (one read-only directory per layer, in overlayfs form, shared by every
sandbox and build that stacks the layer)."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import stat
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core.config import load_config
from ..core.digests import check_digest, object_key
from ..core.errors import CorruptObjectError, DsecError, FormatError, NotFoundError, UsageError
from ..core.files import remove_tree, tree_size
from ..core.units import parse_size
from ..format.index import Entry, LayerIndex
from ..format.manifest import Manifest, load_manifest
from ..format.merge import merge
from ..format.reader import ChunkReader, Fetch
from ..format.refs import resolve
from ..format.tree import OVERLAY_XATTR_PREFIX, TreeWriter, check_rel_path, parent_of
from ..format.validate import check_layer, is_digest
from .dedup import load_index
from .stores.base import Store

log = logging.getLogger(__name__)


def store_fetch(store: Store) -> Fetch:
    def fetch(pack: str, offset: int, length: int) -> bytes:
        return store.get(object_key("packs", pack), offset, length)

    return fetch


#: ranges of one pack closer than this are fetched as one read (the gap is read and dropped)
SPOOL_GAP = 1 << 20
#: the largest single ranged read of a pack when spooling
SPOOL_SPAN = 32 << 20
SPOOL_JOBS = 8


def _spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Coalesce (offset, length) ranges of one pack into few large reads."""
    out: list[tuple[int, int]] = []
    for off, ln in sorted(ranges):
        if out:
            start, length = out[-1]
            end = start + length
            if off <= end + SPOOL_GAP and off + ln - start <= SPOOL_SPAN:
                out[-1] = (start, max(end, off + ln) - start)
                continue
        out.append((off, ln))
    return out


class PackSpool:
    """Every byte range a layer's chunks occupy, fetched as a few large reads per pack run in
    parallel into one sparse local file per pack, then read back by `fetch`.

    Eager materialization from a remote store then costs a handful of requests per pack
    instead of one per file, and grows with bytes, not with files. Chunks are still verified
    by the reader after decoding, so the spool is trusted no more than the store."""

    def __init__(self, store: Store, index: LayerIndex, spool: Path,
                 jobs: int = SPOOL_JOBS) -> None:
        self._fds: dict[str, int] = {}
        spool.mkdir(mode=0o700)
        ranges: dict[int, list[tuple[int, int]]] = {}
        for c in index.chunks:
            ranges.setdefault(c.pack, []).append((c.offset, c.clen))
        try:
            for n in ranges:
                self._fds[index.packs[n]] = os.open(spool / str(n),
                                                    os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            work = [(index.packs[n], off, ln) for n, rs in ranges.items()
                    for off, ln in _spans(rs)]
            # largest first, so the slowest reads start early
            work.sort(key=lambda w: -w[2])
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for _ in pool.map(lambda w: self._get(store, *w), work):
                    pass
        except BaseException:
            self.close()
            raise

    def _get(self, store: Store, pack: str, off: int, ln: int) -> None:
        data = store.get(object_key("packs", pack), off, ln)
        if len(data) != ln:
            raise CorruptObjectError(f"pack {pack[:12]} is shorter than its index says "
                                     f"({off}+{ln})")
        os.pwrite(self._fds[pack], data, off)

    def fetch(self, pack: str, offset: int, length: int) -> bytes:
        fd = self._fds.get(pack)
        if fd is None:
            raise CorruptObjectError(f"pack {pack[:12]} is not one the index lists")
        return os.pread(fd, length, offset)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class ResolvedImage:
    """An image or a single layer, as the list of layers to stack (bottom first)."""

    digest: str
    manifest: Manifest
    layers: list[tuple[str, Manifest]]

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for _, m in self.layers:
            env.update(m.env)
        env.update(self.manifest.env)
        return env

    @property
    def workdir(self) -> str:
        if self.manifest.workdir:
            return self.manifest.workdir
        for _, m in reversed(self.layers):
            if m.workdir:
                return m.workdir
        return "/"


def resolve_image(store: Store, ref: str) -> ResolvedImage:
    digest = resolve(store, ref)
    m = load_manifest(store, digest)
    if m.kind == "layer":
        return ResolvedImage(digest, m, [(digest, m)])
    return ResolvedImage(digest, m, [(d, load_manifest(store, d)) for d in m.layers])


def _reader_for(store: Store, digest: str, m: Manifest) -> tuple[LayerIndex, ChunkReader]:
    """The index of a layer, checked against what its manifest claims (content digest,
    packs, sizes), and a reader over it."""
    if not m.index:
        raise NotFoundError(f"{m.ref} has no index")
    index = load_index(store, m.index)
    check_layer(m, digest, index)
    return index, ChunkReader(index, store_fetch(store), max_read=store.preferred_read_size)


def export(store: Store, ref: str, dest: Path,
           progress: Callable[[str, int], None] | None = None) -> ResolvedImage:
    """Write the merged tree of an image (or one layer) to a directory or a ``.tar`` file."""
    img = resolve_image(store, ref)
    indexes, readers = [], []
    for d, m in img.layers:
        ix, rd = _reader_for(store, d, m)
        indexes.append(ix)
        readers.append(rd)
    entries = merge(indexes)
    if dest.suffix == ".tar":
        _export_tar(entries, readers, dest, progress)
    else:
        check_export_dir(dest)
        with dir_into_place(dest) as tmp, TreeWriter(tmp, overlay_form=False) as w:
            for e, n in entries:
                w.write(e, readers[n].read_file(e) if e.type == "reg" else None)
                if progress:
                    progress("files", 1)
                    if e.type == "reg":
                        progress("bytes", e.size)
            w.finish()
    return img


#: filesystems that are the kernel's interfaces rather than storage: what is written there
#: is kernel state (or fails half-way), never an export
KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
    "securityfs", "configfs", "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc",
    "mqueue", "nsfs", "selinuxfs", "autofs", "hugetlbfs"})
#: errnos that say an export's destination cannot hold it (exit 2); others, such as
#: ENOSPC or EIO, are failures of the write itself (exit 1)
_UNFIT_DEST = frozenset({
    errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY,
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP, errno.EXDEV,
    errno.EINVAL, errno.ENODEV, errno.ENXIO, errno.EOPNOTSUPP})


def _fs_type(dev: int) -> str | None:
    """The type of the mounted filesystem whose device number is ``dev``."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] == want and " - " in line:
                return line.split(" - ", 1)[1].split()[0]
    return None


def check_export_dest(dest: Path) -> None:
    """An export goes to a path on a filesystem that stores files: never onto a device and
    never into a kernel interface (proc, sysfs, devtmpfs, cgroupfs, ...); UsageError naming
    ``dest`` otherwise. Both ``dest`` and the directory its temporary twin is made in
    (its parent) are checked, each as its nearest existing path."""
    for start in (dest, dest.parent):
        probe = Path(os.path.abspath(start))
        with export_errors(dest):
            while True:
                try:
                    st = os.stat(probe)
                    break
                except (FileNotFoundError, NotADirectoryError):
                    if probe == probe.parent:
                        raise
                    probe = probe.parent
        if probe == Path(os.path.abspath(dest)) and (stat.S_ISCHR(st.st_mode)
                                                      or stat.S_ISBLK(st.st_mode)):
            raise UsageError(f"export destination {dest} is a device")
        fstype = _fs_type(st.st_dev)
        if fstype in KERNEL_FILESYSTEMS:
            raise UsageError(f"export destination {dest} is on {fstype}, a kernel interface "
                             "and not a filesystem that stores files")


@contextmanager
def export_errors(dest: Path) -> Iterator[None]:
    """An OSError on an export's destination as an error naming it: a `UsageError` when
    the path cannot hold the export, a `DsecError` when writing failed."""
    try:
        yield
    except OSError as e:
        message = f"cannot export to {dest}: {e.strerror or e}"
        if e.errno in _UNFIT_DEST:
            raise UsageError(message) from e
        raise DsecError(message) from e


def check_export_dir(dest: Path) -> None:
    """An export directory must be new or empty, on a filesystem that stores files."""
    check_export_dest(dest)
    with export_errors(dest):
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise UsageError(f"export destination {dest} exists and is not an empty "
                             "directory")


@contextmanager
def dir_into_place(dest: Path) -> Iterator[Path]:
    """A new directory's path beside ``dest`` to write into, renamed to ``dest`` (replacing an
    empty directory there) when the block ends; if the block fails it is removed, so a
    failed write leaves nothing behind. An OSError is an error naming ``dest``."""
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with export_errors(dest):
            yield tmp
            if dest.exists():
                dest.rmdir()
            os.rename(tmp, dest)
    finally:
        if tmp.exists():
            remove_tree(tmp)


class _Stream(io.RawIOBase):
    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._it = pieces
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


_TAR_TYPES = {"reg": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
              "hard": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE,
              "fifo": tarfile.FIFOTYPE}


def _export_tar(entries: list[tuple[Entry, int]], readers: list[ChunkReader], dest: Path,
                progress: Callable[[str, int], None] | None) -> None:
    check_export_dest(dest)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    kinds: dict[str, str] = {}
    try:
        with export_errors(dest):
            with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
                for e, n in entries:
                    _add_tar_member(tf, e, readers[n], kinds)
                    if progress:
                        progress("files", 1)
            os.replace(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _add_tar_member(tf: tarfile.TarFile, e: Entry, reader: ChunkReader,
                    kinds: dict[str, str]) -> None:
    # a member below a non-directory would make an extracting tar follow a link of the
    # layer's own making: refused, as the tree writer refuses it
    if e.path != ".":
        check_rel_path(e.path)
        parent = parent_of(e.path)
        if kinds.get(parent, "dir") != "dir":
            raise FormatError(f"refusing to export {e.path!r}: {parent!r} is not a directory")
    kinds[e.path] = e.type
    ti = tarfile.TarInfo("." if e.path == "." else f"./{e.path}")
    ti.type = _TAR_TYPES[e.type]
    ti.mode, ti.uid, ti.gid = e.mode, e.uid, e.gid
    ti.mtime = e.mtime // 1_000_000_000
    pax = {"mtime": f"{e.mtime // 1_000_000_000}.{e.mtime % 1_000_000_000:09d}"}
    if e.type == "hard":
        ti.linkname = f"./{check_rel_path(e.target)}"
    elif e.type == "sym":
        ti.linkname = e.target
    if e.rdev:
        ti.devmajor, ti.devminor = e.rdev
    pax.update({f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                for k, v in e.xattrs.items() if not k.startswith(OVERLAY_XATTR_PREFIX)})
    ti.pax_headers = pax
    if e.type == "reg":
        ti.size = e.size
        tf.addfile(ti, io.BufferedReader(_Stream(reader.read_file(e)), 1 << 20))
    else:
        tf.addfile(ti)


class LayerCache:
    """``<root>/layers/<content digest>``: each layer written once, in overlayfs form.

    The name is the content digest the node computed from the index it loaded, never the
    one a manifest claims (a store writer could claim another layer's digest and poison
    every later user of it): ``<root>/verified/<index digest>`` remembers each index's
    computed content digest, so a cached layer costs one small read, not an index load.
    Directories are created atomically (written under a temporary name, then renamed), so
    concurrent users never see a half-written layer; their mtime records the last use, for
    least-recently-used eviction by node gc."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "layers"
        self.root.mkdir(parents=True, exist_ok=True)
        self.verified = Path(root) / "verified"

    def path(self, m: Manifest) -> Path:
        """Where a layer would be cached if its manifest's claim holds (for estimates such
        as placement; `ensure` is what checks the claim)."""
        return self.root / check_digest(m.content_digest)

    def _known_content(self, index_digest: str) -> str | None:
        try:
            text = (self.verified / check_digest(index_digest)).read_text().strip()
        except OSError:
            return None
        return text if is_digest(text) else None

    def _remember(self, index_digest: str, content: str) -> None:
        self.verified.mkdir(parents=True, exist_ok=True)
        tmp = self.verified / f".{index_digest}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(content)
        os.replace(tmp, self.verified / index_digest)

    def verify(self, store: Store, m: Manifest, digest: str = ""
               ) -> tuple[str, LayerIndex | None]:
        """The content digest of layer manifest `m` as this node computed it from the
        index (remembered per index digest), or CorruptObjectError when the manifest's
        claim differs. Also returns the index when it had to be loaded."""
        if m.kind != "layer" or not m.index:
            raise NotFoundError(f"{m.ref} {digest[:12]} is not a layer")
        known = self._known_content(m.index)
        if known is None:
            index = load_index(store, m.index)
            check_layer(m, digest, index)
            known = index.content_digest()
            self._remember(m.index, known)
            return known, index
        if known != m.content_digest:
            raise CorruptObjectError(
                f"layer manifest {digest[:12]} ({m.ref}) claims content digest "
                f"{m.content_digest} but its index {m.index[:12]} has content digest "
                f"{known}; refusing to use it",
                hint="a store writer published a manifest that does not match its index")
        return known, None

    def ensure(self, store: Store, m: Manifest, digest: str = "") -> Path:
        """The cached directory of layer manifest `m` (named `digest` in messages), written
        first if needed; named by the content digest `verify` computed."""
        content, index = self.verify(store, m, digest)
        dest = self.root / content
        if dest.is_dir():
            os.utime(dest, None)
            return dest
        if index is None:
            index = load_index(store, check_digest(str(m.index)))
            if index.content_digest() != content:  # the index object itself changed
                raise CorruptObjectError(f"index {str(m.index)[:12]} no longer has content "
                                         f"digest {content}")
        self._charge(index, m, digest)
        tmp = self.root / f".tmp-{content[:16]}-{uuid.uuid4().hex[:8]}"
        spool = self.root / f".tmp-spool-{content[:16]}-{uuid.uuid4().hex[:8]}"
        try:
            self._write(store, index, tmp, spool)
            try:
                os.rename(tmp, dest)
            except OSError:
                if not dest.is_dir():
                    raise
                log.debug("layer %s was materialized concurrently", content[:12])
        finally:
            for d in (tmp, spool):
                if d.exists():
                    remove_tree(d)
        return dest

    def _charge(self, index: LayerIndex, m: Manifest, digest: str) -> None:
        """Before anything is written: the layer's files must fit the node's cache budget
        (``cache_budget``) on their own, whatever its index claims is shared."""
        size = sum(e.size for e in index.entries if e.type == "reg")
        budget = parse_size(load_config().cache_budget, "cache budget")
        if size > budget:
            raise DsecError(f"layer {digest[:12]} ({m.ref}) holds {size} bytes of files, more "
                            f"than the node's layer cache budget of {budget}",
                            hint="raise cache_budget (DSEC_CACHE_BUDGET) on this node")

    @staticmethod
    def _write(store: Store, index: LayerIndex, tmp: Path, spool: Path) -> None:
        packs = None
        if store.local:
            fetch = store_fetch(store)  # no round trips: nothing to gain from spooling
        else:
            packs = PackSpool(store, index, spool)
            fetch = packs.fetch
        try:
            reader = ChunkReader(index, fetch, max_read=store.preferred_read_size)
            # the index's entries as they come (validated: no path twice); the writer refuses
            # anything that would leave tmp, whatever the order
            with TreeWriter(tmp, overlay_form=True) as w:
                for e in index.entries:
                    w.write(e, reader.read_file(e) if e.type == "reg" else None)
                w.finish()
        finally:
            if packs is not None:
                packs.close()

    def entries(self) -> list[tuple[Path, float, int]]:
        """(path, last use, bytes) of every cached layer."""
        out = []
        for p in self.root.iterdir():
            if p.name.startswith(".tmp-"):
                continue
            out.append((p, p.stat().st_mtime, tree_size(p)))
        return out


@dataclass
class PreparedImage:
    manifest_digest: str
    lower_dirs: list[Path]  # bottom to top
    env: dict[str, str]
    workdir: str
    image: ResolvedImage


def prepare_image(store: Store, ref: str, cache_root: Path) -> PreparedImage:
    """Materialize (once) every layer of an image in the node's layer cache."""
    img = resolve_image(store, ref)
    cache = LayerCache(cache_root)
    started = time.monotonic()
    lowers = [cache.ensure(store, m, d) for d, m in img.layers]
    log.debug("prepared %s in %.3fs", ref, time.monotonic() - started)
    return PreparedImage(img.digest, lowers, img.env, img.workdir, img)
