"""OCI images written from scratch for the tests: layer tarballs from member lists, an OCI
image layout around them, converted and pushed with skopeo."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

LAYER_TYPES = {"gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
               "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
               "none": "application/vnd.oci.image.layer.v1.tar"}


@dataclass
class Member:
    name: str
    data: bytes | None = None  # a regular file
    type: bytes = tarfile.REGTYPE
    linkname: str = ""
    mode: int = 0o644
    mtime: int = 1_700_000_000
    major: int = 0
    minor: int = 0


def file(name: str, data: bytes, mode: int = 0o644) -> Member:
    return Member(name, data, mode=mode)


def directory(name: str, mode: int = 0o755) -> Member:
    return Member(name, None, tarfile.DIRTYPE, mode=mode)


def symlink(name: str, target: str) -> Member:
    return Member(name, None, tarfile.SYMTYPE, target, mode=0o777)


def hardlink(name: str, target: str) -> Member:
    return Member(name, None, tarfile.LNKTYPE, target)


def device(name: str, major: int = 1, minor: int = 3) -> Member:
    return Member(name, None, tarfile.CHRTYPE, mode=0o666, major=major, minor=minor)


def layer_tar(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m in members:
            ti = tarfile.TarInfo(m.name)
            ti.type, ti.mode, ti.mtime, ti.linkname = m.type, m.mode, m.mtime, m.linkname
            ti.devmajor, ti.devminor = m.major, m.minor
            if m.data is not None:
                ti.size = len(m.data)
                tf.addfile(ti, io.BytesIO(m.data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Image:
    layers: list[list[Member] | bytes]  # members, or a whole tar stream
    compression: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/bin:/bin", "GREETING=hi"])
    workdir: str = "/work"
    entrypoint: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])
    cmd: list[str] = field(default_factory=lambda: ["echo hello"])
    user: str = "0:0"
    labels: dict[str, str] = field(default_factory=lambda: {"org.example.kind": "test"})


def write_layout(img: Image, path: Path, tag: str = "v1", *,
                 tamper: int | None = None, lie: int | None = None) -> dict[str, str]:
    """An OCI image layout of ``img``; ``tamper`` changes one byte of that layer's blob
    after its digest is taken, ``lie`` gives that layer a diff_id its bytes do not have (in
    a config, manifest and index hashed around the lie). Returns the digests written (layer
    blobs, diff_ids, manifest)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        d = sha(data)
        (blobs / d[7:]).write_bytes(data)
        return d

    descs, diff_ids = [], []
    for n, members in enumerate(img.layers):
        how = img.compression[n] if n < len(img.compression) else "gzip"
        plain = members if isinstance(members, bytes) else layer_tar(members)
        blob = compress(plain, how)
        d = put(blob)
        if tamper == n:
            bad = bytearray(blob)
            bad[len(bad) // 2] ^= 0xFF
            (blobs / d[7:]).write_bytes(bytes(bad))
        descs.append({"mediaType": LAYER_TYPES[how], "digest": d, "size": len(blob)})
        diff_ids.append("sha256:" + "0" * 64 if lie == n else sha(plain))
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": img.env, "WorkingDir": img.workdir, "User": img.user,
                         "Entrypoint": img.entrypoint, "Cmd": img.cmd, "Labels": img.labels},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cdata = json.dumps(config).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": put(cdata), "size": len(cdata)},
                "layers": descs}
    mdata = json.dumps(manifest).encode()
    md = put(mdata)
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": manifest["mediaType"], "digest": md, "size": len(mdata),
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return {"manifest": md, "diff_ids": json.dumps(diff_ids),
            "layers": json.dumps([x["digest"] for x in descs])}


def skopeo(*args: str) -> None:
    subprocess.run(["skopeo", "--insecure-policy", *args], check=True, capture_output=True,
                   timeout=300)


def base_image() -> Image:
    """Two layers over a busybox-less root: files, a symlink, a hardlink, a big file (cut
    into several chunks), then a layer deleting one file and making a directory opaque."""
    big = bytes(range(256)) * 4096 + hashlib.sha256(b"x").digest() * 20000  # ~1.6 MiB
    bottom = [directory("etc"), file("etc/hostname", b"box\n"), directory("opt"),
              directory("opt/app"), file("opt/app/old.txt", b"old"),
              file("opt/app/keep.txt", b"keep"), file("opt/big.bin", big),
              symlink("etc/link", "hostname"), hardlink("etc/hard", "etc/hostname"),
              directory("var"), directory("var/cache"), file("var/cache/a", b"a" * 100),
              file("bin-tool", b"#!/bin/sh\necho tool\n", 0o755)]
    top = [directory("opt"), directory("opt/app"), file("opt/app/.wh.old.txt", b""),
           directory("var/cache"), file("var/cache/.wh..wh..opq", b""),
           file("var/cache/b", b"b" * 50), file("etc/motd", b"welcome\n" * 3000)]
    return Image([bottom, top], ["gzip", "zstd"])
