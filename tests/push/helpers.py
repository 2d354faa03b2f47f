"""Objects and trees the push tests write: real layers built by `dsec build`, or raw objects."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

from dsec_cli.core.digests import object_key
from dsec_cli.format.index import ChunkLoc, Entry, LayerIndex
from dsec_cli.format.manifest import Manifest, put_manifest
from dsec_cli.format.refs import set_ref
from dsec_cli.push.stores.base import Store

DSEC = str(Path(sys.executable).with_name("dsec"))


def dsec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real `dsec` command line (a run longer than 300 s fails the test), its stderr on
    one line."""
    out = subprocess.run([DSEC, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "200", **(env or {})})
    out.stderr = " ".join(out.stderr.split())  # rich wraps long messages
    return out


def put_object(store: Store, kind: str, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    store.put(object_key(kind, digest), data)
    return digest


def raw_layer(store: Store, name: str, version: str, packs: list[bytes]) -> str:
    """A layer of opaque packs (transfer and gc never look inside them) and a valid index
    that reads each pack whole as one raw chunk (gc sees the packs fully used); a unique
    directory keeps each index distinct."""
    digests = [put_object(store, "packs", p) for p in packs]
    chunks = [ChunkLoc(os.urandom(16), n, 0, len(p), len(p), 0) for n, p in enumerate(packs)]
    files = [Entry(f"f{n}", "reg", size=len(p), chunks=[(n, 0, len(p))])
             for n, p in enumerate(packs)]
    index = LayerIndex(entries=[Entry(".", "dir", 0o755), Entry(os.urandom(8).hex(), "dir"),
                                *files], chunks=chunks, packs=digests)
    ix = put_object(store, "indexes", index.to_bytes())
    m = Manifest(kind="layer", name=name, version=version, index=ix, packs=digests,
                 content_digest=index.content_digest(), files=len(files),
                 size=sum(len(p) for p in packs))
    digest = put_manifest(store, m)
    set_ref(store, name, version, digest)
    return digest


def make_tree(root: Path, seed: int, files: int = 12) -> Path:
    rnd = random.Random(seed)
    for i in range(files):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        size = rnd.choice([0, 100, 5000, 70_000, 300_000])
        (sub / f"f{i}.bin").write_bytes(rnd.randbytes(size))
    (root / "link").symlink_to("d0/f0.bin")
    return root


def write_spec(folder: Path, name: str, version: str) -> Path:
    spec = folder / f"{name}.yaml"
    spec.write_text(f'layer: {name}\nversion: "{version}"\nsteps:\n'
                    f"  - copy: {{src: ./tree, dst: /data}}\n")
    return spec


def build_layer(store_url: str, folder: Path, name: str, version: str) -> str:
    from dsec_cli.build.builder import build

    report = build([write_spec(folder, name, version)], store_url)
    return report.items[-1].manifest


def tree_digest(root: Path) -> dict[str, str]:
    """path -> content digest (or link target) of every file below root."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath, f)
            rel = str(p.relative_to(root))
            out[rel] = (f"-> {os.readlink(p)}" if p.is_symlink()
                        else hashlib.sha256(p.read_bytes()).hexdigest())
    return out
