"""Where OCI and Docker images are read from: a registry (the distribution API, with the
docker credential files and token auth), an OCI image layout directory, or a `docker save`
tarball. Each source hands out manifests and configs (small, size-bounded, checked against
their digest) and layer blobs as streams; what a stream yields is verified by the reader
(`dsec_cli.build.ociimport`), which hashes it as it goes.

Every document read here is hostile input: sizes are bounded, digests and media types
checked, and every name that becomes a path is a validated digest or a member name of the
archive itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..core.errors import IntegrityError, NotFoundError, TransientStoreError, UsageError
from ..push.retry import RetryPolicy, call

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
#: the most a manifest, index or image config may weigh (they are read whole)
MAX_DOC = 4 << 20
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*\Z")


@dataclass(frozen=True)
class Descriptor:
    """A blob as a manifest names it. ``digest`` is None for a `docker save` layer, whose
    file is checked against its uncompressed digest only (docker names it by path)."""

    media_type: str
    digest: str | None
    size: int
    path: str = ""  # member of a docker save tarball

    @classmethod
    def parse(cls, doc: Any, what: str) -> Descriptor:
        if not isinstance(doc, dict):
            raise IntegrityError(f"{what} is not a descriptor object")
        digest, size, mt = doc.get("digest"), doc.get("size"), doc.get("mediaType", "")
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise IntegrityError(f"{what} names digest {str(digest)[:80]!r}, not a sha256 "
                                 "digest (sha256:<64 hex>)")
        if type(size) is not int or size < 0:
            raise IntegrityError(f"{what} has an invalid size {str(size)[:40]!r}")
        if not isinstance(mt, str):
            raise IntegrityError(f"{what} has an invalid media type")
        return cls(mt, digest, size)


def check_digest(data: bytes, digest: str, what: str) -> bytes:
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if got != digest:
        raise IntegrityError(f"{what} does not match its digest {digest}: its bytes hash to "
                             f"{got}")
    return data


def load_doc(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{what} is not a JSON object")
    return doc


class Source:
    """Manifests by reference or digest, and blobs as streams."""

    label: str = ""
    #: the tag or digest the user named, if any
    reference: str = ""
    #: a local source's path (its name is the default image name)
    path: Path = Path("image")

    def root(self) -> tuple[bytes, str, str | None]:
        """The top document (an index or a manifest): bytes, media type, and its digest
        when the source names one."""
        raise NotImplementedError

    def document(self, desc: Descriptor) -> bytes:
        """A manifest or config, read whole (bounded) and checked against its digest."""
        if desc.size > MAX_DOC:
            raise IntegrityError(f"{self.label}: {desc.digest} claims {desc.size} bytes, over "
                                 f"the limit of {MAX_DOC} for a manifest or config")
        with self.blob(desc) as f:
            data = f.read(MAX_DOC + 1)
        if len(data) > MAX_DOC:
            raise IntegrityError(f"{self.label}: {desc.digest} is over {MAX_DOC} bytes")
        assert desc.digest is not None
        return check_digest(data, desc.digest, f"{self.label}: blob")

    def manifest(self, desc: Descriptor) -> bytes:
        """A manifest an index names (a blob like any other, except in a registry)."""
        return self.document(desc)

    @contextmanager
    def blob(self, desc: Descriptor) -> Iterator[IO[bytes]]:
        raise NotImplementedError
        yield  # pragma: no cover

    def close(self) -> None:
        pass


# -- OCI image layout -------------------------------------------------------------------------
class LayoutSource(Source):
    """A directory holding ``oci-layout``, ``index.json`` and ``blobs/sha256/``."""

    def __init__(self, path: Path, tag: str = "") -> None:
        self.path = path
        self.label = f"OCI layout {path}"
        self.reference = tag

    def root(self) -> tuple[bytes, str, str | None]:
        f = self.path / "index.json"
        if f.stat().st_size > MAX_DOC:
            raise IntegrityError(f"{self.label}: index.json is over {MAX_DOC} bytes")
        data = f.read_bytes()
        doc = load_doc(data, f"{self.label}: index.json")
        if self.reference:  # a tag: the manifest the index names so
            for m in doc.get("manifests") or []:
                ann = m.get("annotations") if isinstance(m, dict) else None
                if isinstance(ann, dict) and ann.get("org.opencontainers.image.ref.name") \
                        == self.reference:
                    desc = Descriptor.parse(m, f"{self.label}: index.json entry")
                    return self.document(desc), desc.media_type, desc.digest
            raise NotFoundError(f"{self.label} has no image tagged {self.reference!r}")
        return data, INDEX_TYPES[0], None

    @contextmanager
    def blob(self, desc: Descriptor) -> Iterator[IO[bytes]]:
        assert desc.digest is not None  # parsed: a validated digest, safe as a file name
        p = self.path / "blobs" / "sha256" / desc.digest.removeprefix("sha256:")
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            raise NotFoundError(f"{self.label} lacks blob {desc.digest}") from None
        with f:
            yield f


# -- docker save tarball ----------------------------------------------------------------------
class ArchiveSource(Source):
    """A `docker save` (or `skopeo copy ... docker-archive:`) tarball: ``manifest.json``
    names the config and the layer tarballs by member path. Its blobs are read one at a
    time (members of one open archive share its file position): a thread that opens one
    while another is being read waits for it."""

    def __init__(self, path: Path, tag: str = "") -> None:
        self._one_blob = threading.Lock()
        self.path = path
        self.label = f"docker archive {path}"
        self.reference = tag
        try:
            self.tf = tarfile.open(path, "r:")  # uncompressed: members are read in place
        except (tarfile.TarError, OSError) as e:
            raise UsageError(f"{path} is not a docker save tarball: {e}") from None
        self.members = {m.name.removeprefix("./"): m for m in self.tf.getmembers()}

    def _member(self, name: str) -> IO[bytes]:
        m = self.members.get(name)
        if m is None or not m.isreg():
            raise IntegrityError(f"{self.label} has no file {name[:200]!r}")
        f = self.tf.extractfile(m)
        assert f is not None
        return f

    def root(self) -> tuple[bytes, str, str | None]:
        f = self._member("manifest.json")
        data = f.read(MAX_DOC + 1)
        if len(data) > MAX_DOC:
            raise IntegrityError(f"{self.label}: manifest.json is over {MAX_DOC} bytes")
        try:
            items = json.loads(data)
        except ValueError as e:
            raise IntegrityError(f"{self.label}: manifest.json is not JSON: {e}") from None
        if not isinstance(items, list) or not items:
            raise IntegrityError(f"{self.label}: manifest.json lists no image")
        chosen = items[0]
        if self.reference:
            chosen = next((i for i in items if isinstance(i, dict) and any(
                str(t).endswith(":" + self.reference) or t == self.reference
                for t in i.get("RepoTags") or [])), None)
            if chosen is None:
                raise NotFoundError(f"{self.label} has no image tagged {self.reference!r}")
        elif len(items) > 1:
            raise UsageError(f"{self.label} holds {len(items)} images: name one with "
                             f"{self.path}:TAG")
        if not isinstance(chosen, dict) or not isinstance(chosen.get("Config"), str) \
                or not isinstance(chosen.get("Layers"), list) \
                or not all(isinstance(x, str) for x in chosen["Layers"]):
            raise IntegrityError(f"{self.label}: manifest.json entry lacks Config or Layers")
        config = self._member(chosen["Config"]).read(MAX_DOC + 1)
        if len(config) > MAX_DOC:
            raise IntegrityError(f"{self.label}: the config is over {MAX_DOC} bytes")
        self.config = config
        # a synthesized manifest: the reader treats it as any other, layers by member path
        doc: dict[str, Any] = {
            "schemaVersion": 2, "mediaType": "docker-archive",
            "config": {"digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                       "size": len(config)},
            "layers": [{"path": p} for p in chosen["Layers"]]}
        # the image is known by its config's digest there (docker's image id)
        return json.dumps(doc).encode(), "docker-archive", doc["config"]["digest"]

    def document(self, desc: Descriptor) -> bytes:
        return self.config

    @contextmanager
    def blob(self, desc: Descriptor) -> Iterator[IO[bytes]]:
        with self._one_blob:
            yield self._member(desc.path)

    def close(self) -> None:
        self.tf.close()


# -- registry ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageRef:
    host: str
    repo: str
    tag: str = ""
    digest: str = ""

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.host}/{self.repo}" + (f"@{self.digest}" if self.digest
                                             else f":{self.tag or 'latest'}")


def parse_image_ref(text: str) -> ImageRef:
    """``[host[:port]/]repo[:tag][@sha256:...]``; without a host, Docker Hub, as docker does."""
    rest, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise UsageError(f"image reference {text!r}: {digest!r} is not sha256:<64 hex>")
    first, slash, after = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        host, path = first, after
    else:
        host, path = "registry-1.docker.io", rest if "/" in rest else f"library/{rest}"
    repo, tag = path, ""
    if ":" in path.rsplit("/", 1)[-1]:
        repo, _, tag = path.rpartition(":")
    if not _REPO.match(repo):
        raise UsageError(f"image reference {text!r}: {repo!r} is not a valid repository name")
    if tag and not _TAG.match(tag):
        raise UsageError(f"image reference {text!r}: {tag!r} is not a valid tag")
    return ImageRef(host, repo, tag, digest)


_client_import = threading.Lock()


def _registry_client() -> Any:
    """The OCI store's class, imported by one thread at a time: a run reads several
    registry images side by side, and a second thread must not see the module half made
    (where the import fails, each thread then meets the same clear error)."""
    with _client_import:
        try:
            from .store import OCIStore
        except ImportError as e:  # oras is the optional extra `oci`
            raise UsageError(f"reading images from registries needs the oci extra: {e}",
                             hint="pip install 'dsec[oci]'") from None
    return OCIStore


class RegistrySource(Source):
    """A registry over the distribution API, authenticated as the OCI store is (credentials
    from ``~/.docker/config.json`` or ``$DOCKER_CONFIG``, bearer tokens)."""

    ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

    def __init__(self, ref: ImageRef, insecure: bool) -> None:
        OCIStore = _registry_client()

        self.ref = ref
        self.label = f"registry image {ref}"
        self.reference = ref.reference
        # the store's HTTP client: authentication, timeouts and error mapping, written once
        self.http = OCIStore(f"oci://{ref.host}/{ref.repo}", ref.host, ref.repo, insecure)
        self.policy = RetryPolicy.from_env()  # resolved once: it reads the config files

    def _get(self, path: str, what: str, **kw: Any) -> Any:
        return call(lambda: self.http._request("GET", f"{self.http.base}/{path}", what, **kw),
                    what, self.policy)

    def root(self) -> tuple[bytes, str, str | None]:
        what = f"reading the manifest of {self.ref}"
        r = self._get(f"manifests/{self.ref.reference}", what,
                      headers={"Accept": self.ACCEPT}, stream=True)
        data = r.raw.read(MAX_DOC + 1, decode_content=True)
        r.close()
        if len(data) > MAX_DOC:
            raise IntegrityError(f"{what}: over {MAX_DOC} bytes")
        if self.ref.digest:
            check_digest(data, self.ref.digest, f"the manifest of {self.ref}")
        mt = r.headers.get("Content-Type", "").split(";")[0].strip()
        return data, mt, "sha256:" + hashlib.sha256(data).hexdigest()

    def manifest(self, desc: Descriptor) -> bytes:
        what = f"reading manifest {desc.digest} of {self.ref}"
        if desc.size > MAX_DOC:
            raise IntegrityError(f"{what}: it claims {desc.size} bytes, over {MAX_DOC}")
        r = self._get(f"manifests/{desc.digest}", what, headers={"Accept": self.ACCEPT},
                      stream=True)
        data = r.raw.read(MAX_DOC + 1, decode_content=True)
        r.close()
        assert desc.digest is not None
        return check_digest(data, desc.digest, f"manifest of {self.ref}")

    @contextmanager
    def blob(self, desc: Descriptor) -> Iterator[IO[bytes]]:
        r = self._get(f"blobs/{desc.digest}", f"reading blob {desc.digest} of {self.ref}",
                      stream=True)
        try:
            yield _RawReader(r.raw)  # type: ignore[misc]  # read() is all a reader uses
        finally:
            r.close()

    def close(self) -> None:
        self.http.close()


class _RawReader:
    """A response body as a file: ``read(n)`` without content decoding (blobs are stored
    compressed and hashed as they are)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def read(self, n: int = -1) -> bytes:
        # loaded with the registry client only (what `_registry_client` imports)
        import requests
        import urllib3

        try:
            data: bytes = self.raw.read(None if n < 0 else n, decode_content=False)
        except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException,
                OSError) as e:
            raise TransientStoreError(f"the connection broke while reading a blob: {e}") from e
        return data


def open_source(text: str, insecure: bool = False) -> Source:
    """A source from what the user typed: an existing directory (OCI layout) or file
    (`docker save` tarball), each optionally followed by ``:TAG``; else a registry image."""
    for path, tag in ((text, ""), tuple(text.rsplit(":", 1)) if ":" in text else ("", "")):
        if path and os.path.exists(path):
            p = Path(path)
            if p.is_dir():
                if not (p / "index.json").is_file():
                    raise UsageError(f"{p} is a directory but not an OCI image layout "
                                     "(no index.json)")
                return LayoutSource(p, tag)
            return ArchiveSource(p, tag)
    if text.startswith(("/", ".")):
        raise NotFoundError(f"no OCI layout or docker archive at {text}")
    ref = parse_image_ref(text)
    host = ref.host.rsplit(":", 1)[0] if not ref.host.endswith("]") else ref.host
    # as docker does: a registry on loopback is spoken to over plain HTTP
    loopback = host in ("localhost", "[::1]") or host.startswith("127.")
    return RegistrySource(ref, insecure or loopback)
