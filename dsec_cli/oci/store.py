"""The OCI store: ``oci://host[:port]/repo`` on any registry that speaks the OCI distribution API.

Mapping (docs/stores.md has the whole story):

- content objects (``packs/``, ``indexes/``, ``manifests/``) are blobs, their sha256 key
  digest is the blob digest, so the registry checks every upload against it;
- every other key (refs, pins, leases, gc state) is a tag pointing at a small OCI image
  manifest with its own ``artifactType``, whose first layer holds the value and whose
  ``dev.dsec.key`` annotation holds the key. A ref ``name@version`` is the tag
  `ref_tag(name@version)`; its manifest also lists the whole closure (the dsec manifest as
  config, packs, index, stacked layer manifests), so the registry's own garbage collection
  keeps exactly what refs reach and other OCI tools see a complete artifact;
- the registry cannot list blobs, so listing content keys walks the tags' manifests.

Requests go through the `oras` SDK's registry client for authentication (docker config
credentials, bearer tokens), but are issued here, with timeouts and without oras's own
retry loop, so that `dsec_cli.push.retry` is the one retry policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.cookiejar import DefaultCookiePolicy
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import oras.auth
import oras.container
import requests
import urllib3

from ..core.config import NetTimeouts, net_timeouts
from ..core.digests import parse_object_key, validate_key
from ..core.errors import (
    DsecError,
    IntegrityError,
    NotFoundError,
    StoreError,
    StoreTimeoutError,
    TransientStoreError,
    UsageError,
)
from ..format.closure import closure
from ..push.stores.base import ObjectInfo, Store

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
VALUE_TYPE = "application/vnd.dsec.value.v1"
KIND_TYPES = {  # media types of the content objects, as they appear in ref artifacts
    "packs": "application/vnd.dsec.pack.v1",
    "indexes": "application/vnd.dsec.index.v1",
    "manifests": "application/vnd.dsec.manifest.v1+json",
}
TYPE_KINDS = {v: k for k, v in KIND_TYPES.items()}
ARTIFACT_TYPES = {"refs": "application/vnd.dsec.ref.v1", "pins": "application/vnd.dsec.pin.v1",
                  "leases": "application/vnd.dsec.lease.v1", "gc": "application/vnd.dsec.gc.v1"}
KEY_ANNOTATION = "dev.dsec.key"
TIME_ANNOTATION = "dev.dsec.mtime"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # the distribution spec's grammar
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*\Z")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_ESC = {"_": "__", "/": "_s", "@": "_a", "+": "_p"}
_UNESC = {v[1]: k for k, v in _ESC.items()}


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """Every request on the session gets the configured timeouts, including the ones oras
    makes itself (bearer token requests), which pass none."""

    def __init__(self, timeouts: NetTimeouts, **kw: Any) -> None:
        self.timeouts = timeouts
        super().__init__(**kw)

    def send(self, request: Any, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        if kw.get("timeout") is None:
            kw["timeout"] = (self.timeouts.connect, self.timeouts.read)
        return super().send(request, *args, **kw)


# -- tag escaping ---------------------------------------------------------------------------
def key_to_tag(key: str) -> str:
    """The tag of a mutable key. ``refs/NAME/VERSION`` is tagged as ``NAME@VERSION``; tags
    cannot hold '@', '+' or '/', so '_' escapes: '_'->'__', '/'->'_s', '@'->'_a', '+'->'_p'
    (``python@3.11+1`` -> ``python_a3.11_p1``). A tag that would be invalid (too long, or
    starting with '.' or '-') becomes ``_h`` + sha256(key); the key is in its annotation."""
    parts = key.split("/")
    text = f"{parts[1]}@{parts[2]}" if len(parts) == 3 and parts[0] == "refs" else key
    tag = "".join(_ESC.get(c, c) for c in text)
    if "/" not in key and "@" in key or not _TAG.match(tag):
        return "_h" + hashlib.sha256(key.encode()).hexdigest()
    return tag


def tag_to_key(tag: str) -> str | None:
    """Inverse of `key_to_tag`; None for hashed tags (read their annotation) and foreign tags."""
    if tag.startswith("_h"):
        return None
    out, i = [], 0
    while i < len(tag):
        c = tag[i]
        if c == "_":
            if i + 1 >= len(tag) or tag[i + 1] not in _UNESC:
                return None  # not one of ours
            out.append(_UNESC[tag[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    text = "".join(out)
    if "/" not in text and "@" in text:
        name, _, version = text.partition("@")
        return f"refs/{name}/{version}"
    return text if "/" in text else None


def _docker_config() -> dict[str, Any]:
    """The docker client's credentials: ``$DOCKER_CONFIG/config.json`` when that is set
    (as docker reads it), else ``~/.docker/config.json``; a file that cannot be read
    counts as no credentials."""
    folder = os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker")
    try:
        doc = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    auths = doc.get("auths") if isinstance(doc.get("auths"), dict) else {}
    helpers = doc.get("credHelpers") if isinstance(doc.get("credHelpers"), dict) else {}
    store = doc.get("credsStore") if isinstance(doc.get("credsStore"), str) else None
    # never empty: oras reads ~/.docker/config.json itself when it finds no config
    return {"auths": auths, "credsStore": store, "credHelpers": helpers}


class _Client:
    """What requests to a registry go through: one session, and oras's authentication
    (docker config credentials, bearer tokens) sharing it. oras's own ``Registry`` client is
    not made: only these two parts of it are used, and importing it costs a run about 30 ms
    of schema validation machinery it never uses here."""

    def __init__(self, insecure: bool) -> None:
        self.session = requests.Session()
        # no cookies: some registries take one being sent back as the sign of a browser
        self.session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        self.auth = oras.auth.get_auth_backend("token", self.session, insecure)


class OCIStore(Store):
    scheme: ClassVar[str] = "oci"
    preferred_read_size: ClassVar[int] = 8 << 20

    def __init__(self, url: str, host: str, repo: str, insecure: bool) -> None:
        super().__init__(url)
        self.host = host
        self.repo = repo
        self.insecure = insecure
        self.base = f"{'http' if insecure else 'https'}://{host}/v2/{repo}"
        self.reg = _Client(insecure)
        self.timeouts = net_timeouts()
        self.timeout = (self.timeouts.connect, self.timeouts.read)
        for prefix in ("http://", "https://"):
            self.reg.session.mount(prefix, _TimeoutAdapter(self.timeouts, pool_maxsize=32))
        # credentials from ~/.docker/config.json (and credential helpers), as docker and oras do
        self.reg.auth._auth_config = _docker_config()  # oras itself ignores $DOCKER_CONFIG
        self.reg.auth.load_configs(oras.container.Container(repo, registry=host))
        self._have_empty = False

    @classmethod
    def from_url(cls, url: str, **options: object) -> OCIStore:
        parsed = urlparse(url)
        repo = parsed.path.strip("/")
        if not parsed.netloc or not repo:
            raise UsageError(f"OCI store URL {url!r} needs a registry and a repository",
                             hint="oci://HOST[:PORT]/REPOSITORY")
        if not _REPO.match(repo):
            raise UsageError(f"{repo!r} in {url!r} is not a valid OCI repository name "
                             "(lower-case letters, digits, '.', '_', '-', '/')")
        query = parse_qs(parsed.query)
        insecure = bool(options.get("insecure")) or query.get("insecure", [""])[0] in ("1", "true")
        store = cls(f"oci://{parsed.netloc}/{repo}", parsed.netloc, repo, insecure)
        store.check()
        return store

    # -- HTTP with error mapping ------------------------------------------------------------
    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except DsecError:
            raise
        except requests.exceptions.SSLError as e:
            raise StoreError(f"{what}: TLS failed with {self.host}: {e}",
                             hint="for a plain-HTTP registry pass --insecure") from e
        except requests.exceptions.ConnectTimeout as e:
            raise StoreTimeoutError(f"{what}: cannot connect to {self.host} within "
                                    f"{self.timeouts.connect:g}s",
                                    waited=self.timeouts.connect) from e
        except (requests.exceptions.Timeout, urllib3.exceptions.ReadTimeoutError) as e:
            raise StoreTimeoutError(f"{what}: {self.host} accepted the connection but did not "
                                    f"answer within {self.timeouts.read:g}s",
                                    waited=self.timeouts.read) from e
        except requests.exceptions.ConnectionError as e:
            raise TransientStoreError(f"{what}: cannot reach {self.host}: "
                                      f"{type(e).__name__}") from e
        except (oras.auth.AuthenticationException, ValueError) as e:
            raise StoreError(f"{what}: {self.host} refused our credentials: {e}",
                             hint="run `docker login` (or edit ~/.docker/config.json)") from e
        except requests.exceptions.RequestException as e:
            raise StoreError(f"{what}: {e}") from e
        except urllib3.exceptions.HTTPError as e:  # a body cut short by the connection
            raise TransientStoreError(f"{what}: connection to {self.host} broke: {e}") from e

    def _request(self, method: str, url: str, what: str, ok: tuple[int, ...] = (200,),
                 missing_ok: bool = False, **kw: Any) -> requests.Response | None:
        """One request, authenticated as oras does it; maps the status to dsec errors."""
        headers = dict(kw.pop("headers", None) or {})
        with self._errors(what):
            token = getattr(self.reg.auth, "token", None)
            if token:
                headers.update(self.reg.auth.get_auth_header())
            r = self.reg.session.request(method, url, headers=headers, timeout=self.timeout, **kw)
            if r.status_code in (401, 403):
                headers, changed = self._authenticate(r, headers)
                if changed:
                    body: Any = kw.get("data")
                    if hasattr(body, "seek"):
                        body.seek(0)  # a streamed upload is sent again from its start
                    r = self.reg.session.request(method, url, headers=headers, timeout=self.timeout,
                                                 **kw)
        if r.status_code in ok:
            return r
        if r.status_code == 404 and missing_ok:
            return None
        raise self._status_error(r, what)

    def _authenticate(self, r: requests.Response, headers: dict[str, str]
                      ) -> tuple[dict[str, str], bool]:
        """Answer a challenge: a Basic one with the docker config's credentials (oras speaks
        bearer tokens only), anything else through oras."""
        challenge = r.headers.get("Www-Authenticate", "")
        if challenge[:6].lower() == "basic ":
            basic = getattr(self.reg.auth, "_basic_auth", None)
            if not basic or headers.get("Authorization") == f"Basic {basic}":
                return headers, False
            return {**headers, "Authorization": f"Basic {basic}"}, True
        out: tuple[dict[str, str], bool] = self.reg.auth.authenticate_request(r, headers)
        return out

    def _status_error(self, r: requests.Response, what: str) -> DsecError:
        detail = ""
        try:
            errs = r.json().get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs)
        except ValueError:
            detail = r.text[:200]
        msg = f"{what}: {self.host} answered {r.status_code} {detail}".rstrip()
        if r.status_code == 429 or r.status_code >= 500:
            return TransientStoreError(msg)
        if r.status_code in (401, 403):
            return StoreError(msg, hint="run `docker login` (or edit ~/.docker/config.json)")
        if r.status_code == 404:
            if "NAME_UNKNOWN" in detail:
                return NotFoundError(f"{what}: repository {self.repo} does not exist yet")
            return NotFoundError(f"{what}: not found in {self.url}")
        if "DIGEST_INVALID" in detail:
            return IntegrityError(msg)
        if r.status_code == 405 and r.request.method == "DELETE":
            return StoreError(msg, hint="the registry must allow deletes "
                                        "(distribution: storage.delete.enabled: true)")
        return StoreError(msg)

    def check(self) -> None:
        """Fail early on a registry that does not answer or does not speak the v2 API."""
        url = f"{'http' if self.insecure else 'https'}://{self.host}/v2/"
        with self._errors(f"opening {self.url}"):
            r = self.reg.session.get(url, timeout=self.timeout)
        if r.status_code == 429 or r.status_code >= 500 or r.status_code == 403:
            raise self._status_error(r, f"opening {self.url}")  # 403: a registry refusing us
        if r.status_code not in (200, 401):
            raise UsageError(f"{self.host} does not look like an OCI registry "
                             f"(GET /v2/ answered {r.status_code})")

    # -- blobs ------------------------------------------------------------------------------
    def _blob_url(self, digest: str) -> str:
        return f"{self.base}/blobs/sha256:{digest}"

    def _head_blob(self, digest: str, what: str) -> int | None:
        r = self._request("HEAD", self._blob_url(digest), what, missing_ok=True)
        return None if r is None else int(r.headers.get("Content-Length", 0))

    def _get_blob(self, digest: str, what: str, start: int = 0, length: int | None = None
                  ) -> bytes:
        if length == 0:
            return b""
        headers = {}
        if start or length is not None:
            headers["Range"] = f"bytes={start}-{'' if length is None else start + length - 1}"
        # streamed, so that the status is seen before the body: distribution answers an
        # unsatisfiable range with a 416 whose Content-Length is the whole blob's
        r = self._request("GET", self._blob_url(digest), what, ok=(200, 206, 416),
                          headers=headers, stream=True)
        assert r is not None
        if r.status_code == 416:
            r.close()
            return b""
        with self._errors(what):
            # one read of the whole body: requests' .content loops over 10 KiB pieces, which
            # halves throughput with several transfers in flight
            data = r.raw.read(decode_content=True)
        if r.status_code == 200 and (start or length is not None):
            data = data[start:None if length is None else start + length]  # range ignored
        return data

    def _upload(self, digest: str, body: Any, size: int, what: str) -> None:
        r = self._request("POST", f"{self.base}/blobs/uploads/", what, ok=(202,),
                          headers={"Content-Length": "0"})
        assert r is not None
        loc = r.headers.get("Location", "")
        if not loc.startswith("http"):
            loc = f"{'http' if self.insecure else 'https'}://{self.host}{loc}"
        sep = "&" if "?" in loc else "?"
        self._request("PUT", f"{loc}{sep}digest=sha256:{digest}", what, ok=(201,), data=body,
                      headers={"Content-Type": "application/octet-stream",
                               "Content-Length": str(size)})

    def _put_blob(self, data: bytes, what: str) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if self._head_blob(digest, what) is None:
            self._upload(digest, data, len(data), what)
        return digest

    # -- tagged manifests (mutable keys) -----------------------------------------------------
    def _manifest_url(self, reference: str) -> str:
        return f"{self.base}/manifests/{reference}"

    def _get_tag(self, tag: str, what: str) -> dict[str, Any] | None:
        r = self._request("GET", self._manifest_url(tag), what, missing_ok=True,
                          headers={"Accept": OCI_MANIFEST})
        if r is None:
            return None
        doc: dict[str, Any] = r.json()
        return doc

    @staticmethod
    def _value_layer(doc: dict[str, Any]) -> dict[str, Any] | None:
        for layer in doc.get("layers", []):
            if layer.get("mediaType") == VALUE_TYPE:
                return dict(layer)
        return None

    def _ensure_empty_config(self, what: str) -> None:
        if not self._have_empty:
            self._put_blob(b"{}", what)
            self._have_empty = True

    def _put_tag(self, key: str, data: bytes) -> None:
        what = f"writing {key}"
        digest = self._put_blob(data, what)
        folder = key.split("/", 1)[0]
        config = {"mediaType": EMPTY_TYPE, "digest": EMPTY_DIGEST, "size": 2}
        layers = [{"mediaType": VALUE_TYPE, "digest": f"sha256:{digest}", "size": len(data)}]
        if folder == "refs":
            config, closure = self._ref_closure(data, what)
            layers += closure
        else:
            self._ensure_empty_config(what)
        doc = {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "artifactType": ARTIFACT_TYPES.get(folder, "application/vnd.dsec.object.v1"),
            "config": config, "layers": layers,
            "annotations": {KEY_ANNOTATION: key, TIME_ANNOTATION: f"{time.time():.6f}"},
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        self._request("PUT", self._manifest_url(key_to_tag(key)), what, ok=(201,), data=body,
                      headers={"Content-Type": OCI_MANIFEST})

    def _ref_closure(self, data: bytes, what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The dsec manifest (as config) and every object it reaches, as descriptors."""
        manifest = json.loads(data)["manifest"]
        keys = closure(self, manifest)

        def describe(key: str) -> dict[str, Any]:
            kind, digest = parse_object_key(key) or ("", "")
            size = self._head_blob(digest, what)
            if size is None:
                raise NotFoundError(f"{what}: {key} is missing from {self.url}; "
                                    "a ref must be written after what it reaches")
            return {"mediaType": KIND_TYPES[kind], "digest": f"sha256:{digest}", "size": size}

        with ThreadPoolExecutor(8) as pool:
            descs = list(pool.map(describe, keys))
        top = next(d for d in descs if d["digest"] == f"sha256:{manifest}")
        return top, [d for d in descs if d is not top]

    def _delete_tag(self, key: str) -> None:
        what = f"deleting {key}"
        r = self._request("HEAD", self._manifest_url(key_to_tag(key)), what, missing_ok=True,
                          headers={"Accept": OCI_MANIFEST})
        if r is None:
            return
        digest = r.headers.get("Docker-Content-Digest")
        if not digest:
            raise StoreError(f"{what}: {self.host} did not say which manifest the tag names")
        # each key's manifest is unique (its annotation holds the key), so deleting it by
        # digest removes exactly this tag
        self._request("DELETE", self._manifest_url(digest), what, ok=(202,), missing_ok=True)

    def _tags(self) -> list[str]:
        tags: list[str] = []
        url: str | None = f"{self.base}/tags/list?n=1000"
        while url:
            r = self._request("GET", url, "listing tags", missing_ok=True)
            if r is None:
                return tags  # a repository that does not exist yet has no tags
            tags += r.json().get("tags") or []
            nxt = r.links.get("next", {}).get("url")
            url = None if not nxt else (nxt if nxt.startswith("http") else
                                        f"{'http' if self.insecure else 'https'}://"
                                        f"{self.host}{nxt}")
        return tags

    # -- primitives --------------------------------------------------------------------------
    def _get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        what = f"reading {key}"
        obj = parse_object_key(key)
        if obj:
            try:
                return self._get_blob(obj[1], what, start, length)
            except NotFoundError:
                raise NotFoundError(f"{key} not found in {self.url}") from None
        doc = self._get_tag(key_to_tag(key), what)
        layer = self._value_layer(doc or {})
        if doc is None or layer is None:
            raise NotFoundError(f"{key} not found in {self.url}")
        data = self._get_blob(layer["digest"].removeprefix("sha256:"), what)
        return data[start:None if length is None else start + length]

    def _put(self, key: str, data: bytes) -> None:
        obj = parse_object_key(key)
        if obj:
            digest = hashlib.sha256(data).hexdigest()
            if digest != obj[1]:
                raise IntegrityError(f"writing {key}: its bytes hash to {digest}; an OCI store "
                                     "names blobs by the sha256 of their bytes")
            self._upload(digest, data, len(data), f"writing {key}")
        else:
            self._put_tag(key, data)

    def put_file(self, key: str, path: Path) -> None:
        validate_key(key)
        obj = parse_object_key(key)
        if not obj:
            return self._put(key, Path(path).read_bytes())
        with open(path, "rb") as f:  # streamed: the registry checks the digest
            self._upload(obj[1], f, Path(path).stat().st_size, f"writing {key}")
        return None

    def _stat(self, key: str) -> ObjectInfo | None:
        what = f"checking {key}"
        obj = parse_object_key(key)
        if obj:
            size = self._head_blob(obj[1], what)
            return None if size is None else ObjectInfo(key, size, 0.0)
        doc = self._get_tag(key_to_tag(key), what)
        return self._info(key, doc) if doc else None

    @classmethod
    def _info(cls, key: str, doc: dict[str, Any]) -> ObjectInfo | None:
        layer = cls._value_layer(doc)
        if layer is None:
            return None
        mtime = float(doc.get("annotations", {}).get(TIME_ANNOTATION, 0) or 0)
        return ObjectInfo(key, int(layer["size"]), mtime)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        docs: dict[str, dict[str, Any]] = {}
        for tag in self._tags():
            key = tag_to_key(tag)
            if key is not None and not key.startswith(prefix) and not (
                    key.startswith("refs/") and self._lists_objects(prefix)):
                continue
            doc = self._get_tag(tag, "listing")
            if doc is None:
                continue  # deleted while listing
            key = doc.get("annotations", {}).get(KEY_ANNOTATION) or key
            if key:
                docs[key] = doc
        seen: set[str] = set()
        for key, doc in sorted(docs.items()):
            if key.startswith(prefix):
                info = self._info(key, doc)
                if info:
                    yield info
            if key.startswith("refs/") and self._lists_objects(prefix):
                yield from self._walk_artifact(doc, prefix, seen)

    @staticmethod
    def _lists_objects(prefix: str) -> bool:
        return any(kind.startswith(prefix) or prefix.startswith(kind) for kind in KIND_TYPES)

    @staticmethod
    def _walk_artifact(doc: dict[str, Any], prefix: str, seen: set[str]) -> Iterator[ObjectInfo]:
        for desc in [doc.get("config", {}), *doc.get("layers", [])]:
            kind = TYPE_KINDS.get(desc.get("mediaType", ""))
            if not kind:
                continue
            digest = desc["digest"].removeprefix("sha256:")
            key = f"{kind}/{digest[:2]}/{digest}"
            if key.startswith(prefix) and key not in seen:
                seen.add(key)
                yield ObjectInfo(key, int(desc.get("size", 0)), 0.0)

    def _delete(self, key: str) -> None:
        obj = parse_object_key(key)
        if obj:
            self._request("DELETE", self._blob_url(obj[1]), f"deleting {key}", ok=(202,),
                          missing_ok=True)
        else:
            self._delete_tag(key)

    def close(self) -> None:
        self.reg.session.close()
