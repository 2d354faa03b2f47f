"""The embedded store: a directory, locally or on a cluster filesystem (NFS, CephFS, 3FS).

Every write goes to a unique temporary file in ``<root>/tmp/`` and is renamed into place, so
readers and concurrent writers only ever see whole objects, and a writer killed at any point
leaves at most a temporary file (removed by gc). Objects are fsynced before the rename, so a
ref never survives a machine crash that lost the data it points to. Inside `write_batch`,
a thread's objects are all fsynced together (in parallel: the filesystem commits them at
once) and then renamed in the order they were put, so the same holds with one wait for the
disk instead of one per object.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar
from urllib.parse import unquote, urlparse

from ...core.digests import validate_key
from ...core.errors import NotFoundError, StoreError, UsageError
from ...core.files import fsync_path
from .base import ObjectInfo, Store


class FileStore(Store):
    scheme: ClassVar[str] = "file"
    preferred_read_size: ClassVar[int] = 1 << 20
    local: ClassVar[bool] = True

    def __init__(self, url: str, root: Path) -> None:
        super().__init__(url)
        self.root = root
        self.tmp = root / "tmp"
        self._batches = threading.local()  # per thread: [(tmp, key)] waiting in a batch
        self._tmp_made = False  # the store's directories are made by its first write only

    def missing(self) -> str:
        return "" if self.root.is_dir() else str(self.root)

    def _tmp_dir(self) -> Path:
        """``<root>/tmp``, made on first use: opening a store to read it creates nothing."""
        if not self._tmp_made:
            try:
                self.tmp.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UsageError(f"cannot use {self.root} as a store: {e.strerror}") from e
            self._tmp_made = True
        return self.tmp

    @classmethod
    def from_url(cls, url: str, **options: object) -> FileStore:
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise UsageError(f"file:// URLs name a local path, not a host: {url!r}")
        try:
            path = Path(unquote(parsed.path, errors="strict"))
        except UnicodeDecodeError:
            raise UsageError(f"invalid store URL {url!r}: its path is not valid UTF-8"
                             ) from None
        if not path.is_absolute():
            raise UsageError(f"file:// store path must be absolute: {url!r}")
        return cls(url, path)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _pending(self, key: str) -> Path | None:
        """The temporary file of an object this thread's batch has not shown yet."""
        batch = getattr(self._batches, "items", None)
        if batch:
            for tmp, k in reversed(batch):
                if k == key:
                    return tmp
        return None

    def _get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._pending(key) or self._path(key), "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise NotFoundError(f"{key} not found in {self.url}") from None
        except OSError as e:
            raise StoreError(f"reading {key} from {self.url}: {e.strerror}") from e

    def _tmp_name(self) -> Path:
        return self._tmp_dir() / f"{uuid.uuid4().hex}.tmp"

    def _commit(self, tmp: Path, key: str) -> None:
        dest = self._path(key)
        try:
            os.replace(tmp, dest)
        except FileNotFoundError:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)

    def _put(self, key: str, data: bytes) -> None:
        tmp = self._tmp_name()
        batch = getattr(self._batches, "items", None)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # less the umask
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if batch is None:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if batch is not None:
                batch.append((tmp, key))  # synced and shown when the batch ends
                return
            self._commit(tmp, key)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"writing {key} to {self.url}: {e.strerror}") from e

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """This thread's puts inside are written to temporary files without waiting for the
        disk; at the end they are all fsynced at once, then renamed into place in the order
        they were put, so each is on disk before any is visible. A block that fails shows
        none of them. Nested, the outermost batch commits."""
        if getattr(self._batches, "items", None) is not None:
            yield
            return
        batch: list[tuple[Path, str]] = []
        self._batches.items = batch
        done = False
        try:
            yield
            done = True
        finally:
            self._batches.items = None
            if done:
                self._commit_batch(batch)
            else:
                for tmp, _ in batch:
                    tmp.unlink(missing_ok=True)

    def _commit_batch(self, batch: list[tuple[Path, str]]) -> None:
        shown = 0
        try:
            if len(batch) == 1:
                fsync_path(batch[0][0])
            elif batch:
                with ThreadPoolExecutor(min(8, len(batch))) as pool:
                    list(pool.map(fsync_path, [tmp for tmp, _ in batch]))
            for tmp, key in batch:  # in the order they were put
                self._commit(tmp, key)
                shown += 1
        except OSError as e:
            for tmp, _ in batch[shown:]:
                tmp.unlink(missing_ok=True)
            key = batch[shown][1] if shown < len(batch) else "a batch"
            raise StoreError(f"writing {key} to {self.url}: {e.strerror}") from e

    def put_file(self, key: str, path: Path) -> None:
        """A hard link when the file is on the store's filesystem, a copy otherwise."""
        validate_key(key)
        tmp = self._tmp_name()
        try:
            try:
                os.link(path, tmp)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                shutil.copyfile(path, tmp)
            batch = getattr(self._batches, "items", None)
            if batch is not None:
                batch.append((tmp, key))  # synced and shown when the batch ends
                return
            fsync_path(tmp)
            self._commit(tmp, key)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"writing {key} to {self.url}: {e.strerror}") from e

    def _stat(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self._pending(key) or self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = prefix.rpartition("/")[0]
        top = self.root / base if base else self.root
        for dirpath, dirnames, filenames in os.walk(top):
            rel = os.path.relpath(dirpath, self.root)
            if rel == "tmp" or rel.startswith("tmp/"):
                dirnames[:] = []
                continue
            dirnames.sort()
            for name in sorted(filenames):
                key = name if rel == "." else f"{rel}/{name}"
                if not key.startswith(prefix) or name.endswith(".tmp"):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while listing
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"deleting {key} from {self.url}: {e.strerror}") from e

    def staging_dir(self) -> Path:
        """A directory on the store's filesystem, so packs written there link in for free."""
        return self._tmp_dir()
