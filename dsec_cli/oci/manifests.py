"""What an OCI image's documents say, read as hostile input: the manifest an index names for
a platform, the config and layer descriptors of a manifest (media types dsec imports), and
the image config's settings as a dsec image's env, workdir and annotations (user,
entrypoint, cmd, labels), bounded so the dsec manifest stays readable. `dsec import` and
`dsec build Dockerfile` read image configs through the same mapping."""

from __future__ import annotations

import json
import platform as _platform
import re
from typing import Any

from ..core.errors import IntegrityError, NotFoundError, UsageError
from ..format.validate import MAX_TEXT
from .sources import Descriptor, Source

LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar", "",
}
#: the most the env, workdir and annotations taken from an image config may weigh in all
MAX_SETTINGS = 1 << 20
#: a sha256 digest as image documents spell it
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def host_platform() -> str:
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(
        _platform.machine(), _platform.machine())
    return f"linux/{arch}"


def pick_platform(index: dict[str, Any], want: str, label: str) -> Descriptor:
    items = index.get("manifests")
    if not isinstance(items, list) or not items:
        raise IntegrityError(f"{label}: the image index lists no manifest")
    os_, _, rest = want.partition("/")
    arch, _, variant = rest.partition("/")
    seen = []
    for n, m in enumerate(items):
        desc = Descriptor.parse(m, f"{label}: index entry {n}")
        p = m.get("platform") if isinstance(m, dict) else None
        if not isinstance(p, dict):
            if len(items) == 1:
                return desc
            continue
        have = f"{p.get('os')}/{p.get('architecture')}" + (
            f"/{p['variant']}" if p.get("variant") else "")
        seen.append(have)
        if p.get("os") == os_ and p.get("architecture") == arch and (
                not variant or p.get("variant") == variant):
            return desc
    if not seen:
        raise UsageError(f"{label} lists {len(items)} images and no platforms",
                         hint="name one by its tag (SOURCE:TAG)")
    raise NotFoundError(f"{label} has no image for platform {want}",
                        hint=f"it has: {', '.join(seen)}; choose with --platform")


def layers_of(doc: dict[str, Any], label: str) -> tuple[Descriptor, list[Descriptor]]:
    if doc.get("mediaType") == "docker-archive":  # synthesized by the archive source
        cfg = doc["config"]
        return (Descriptor("", cfg["digest"], cfg["size"]),
                [Descriptor("", None, 0, path=x["path"]) for x in doc["layers"]])
    if doc.get("schemaVersion") != 2:
        raise UsageError(f"{label}: manifest schema version {doc.get('schemaVersion')!r} is not "
                         "supported (Docker schema 2 and OCI manifests are)")
    config = Descriptor.parse(doc.get("config"), f"{label}: config descriptor")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise IntegrityError(f"{label}: the manifest has no layer list")
    out = [Descriptor.parse(x, f"{label}: layer {n}") for n, x in enumerate(layers)]
    for d in out:
        if d.media_type not in LAYER_TYPES:
            raise UsageError(f"{label}: layer {d.digest} has media type {d.media_type!r}, "
                             "which dsec does not import (tar, tar+gzip, tar+zstd)")
    return config, out


def _str_list(v: Any) -> list[str] | None:
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    return None


def image_settings(config: dict[str, Any], label: str) -> tuple[dict[str, str], str,
                                                                dict[str, str]]:
    """env, workdir, and the rest (user, entrypoint, cmd, labels) as annotations."""
    c = config.get("config") or {}
    if not isinstance(c, dict):
        raise IntegrityError(f"{label}: the image config's 'config' is not an object")
    env: dict[str, str] = {}
    for item in _str_list(c.get("Env")) or []:
        k, sep, v = item.partition("=")
        if sep and k and "\x00" not in item:
            env[k] = v
    workdir = c.get("WorkingDir") if isinstance(c.get("WorkingDir"), str) else ""
    ann: dict[str, str] = {}
    if isinstance(c.get("User"), str) and c["User"]:
        ann["oci.user"] = c["User"]
    for key, name in (("Entrypoint", "oci.entrypoint"), ("Cmd", "oci.cmd")):
        items = _str_list(c.get(key))
        if items is not None:
            ann[name] = json.dumps(items)
    labels = c.get("Labels")
    if isinstance(labels, dict):
        for k, v in labels.items():
            if isinstance(v, str) and k:
                ann[f"oci.label.{k}"] = v
    if isinstance(c.get("StopSignal"), str):
        ann["oci.stop_signal"] = c["StopSignal"]
    ann = {k: v for k, v in ann.items() if "\x00" not in k + v}
    workdir = workdir or ""
    if "\x00" in workdir:
        raise IntegrityError(f"{label}: the image config's WorkingDir holds a NUL byte")
    if workdir and not workdir.startswith("/"):
        workdir = "/" + workdir  # as docker reads a relative WorkingDir
    # what becomes the dsec manifest must stay readable under its bounds
    texts = [workdir, *env, *env.values(), *ann, *ann.values()]
    if any(len(t) > MAX_TEXT for t in texts) or sum(map(len, texts)) > MAX_SETTINGS:
        raise IntegrityError(f"{label}: the image config's env, labels or command are too "
                             f"large (each at most {MAX_TEXT} characters, "
                             f"{MAX_SETTINGS} in all)")
    return env, workdir, ann


def default_name(source: Source) -> tuple[str, str]:
    ref = getattr(source, "ref", None)
    if ref is not None:
        name = ref.repo.rsplit("/", 1)[-1]
        version = ref.tag or (ref.digest.removeprefix("sha256:")[:12] if ref.digest
                              else "latest")
    else:
        path = source.path
        name = path.name.split(".")[0] or "image"
        version = source.reference or "latest"
    return (_SAFE.sub("-", name).strip("-.") or "image")[:128], \
        (_SAFE.sub("-", version).strip("-.") or "latest")[:128]
