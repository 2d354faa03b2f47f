"""Dockerfile builds: `dsec build DOCKERFILE` against `buildah bud` (vfs storage, chroot
isolation) on the same Dockerfiles.

    python -m benchmarks dockerfile [--bases N] [--images N]

A SWE-style library: ``--bases`` (default 4) env Dockerfiles over one Debian minbase
(``debootstrap --variant=minbase bookworm``, made once and kept in /var/tmp): the base
added from a tar, a RUN that adds a user and chowns a tree to it, a COPY of a "python env"
tree (/usr/lib/python3.11 with 1% of its files edited per base). Then ``--images``
(default 20) instance Dockerfiles, each over one of the env images: a COPY of a repository
tree (a slice of /usr/share/doc, one file edited per image), a RUN writing into it as the
non-root user, WORKDIR, USER, CMD. Both tools build the same files one after the other
(bases first, then instances), then every instance Dockerfile once more (a no-op rebuild).
No RUN reaches the network, so the figures are the tools' own.

Reported: wall time of each phase for both, their ratio, and the bytes each stores
(dsec: its file store; buildah: its vfs storage dir) against the unique bytes of the
library (the base tar plus each tree added once). Results: benchmarks/results/dockerfile.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import du, save
from tests.debian import debian_tar as _debian


def _tree(src: Path, dest: Path, edit: int, every: int) -> None:
    shutil.copytree(src, dest, symlinks=True)
    files = sorted(p for p in dest.rglob("*") if p.is_file() and not p.is_symlink())
    for n, p in enumerate(files):
        if n % every == edit % every:
            with open(p, "ab") as f:
                f.write(f"\n# edit {edit}\n".encode())


def _library(work: Path, bases: int, images: int) -> tuple[list[Path], list[Path], int]:
    """The Dockerfiles' contexts (env, then instance) and the library's unique bytes."""
    tar = _debian()
    unique = tar.stat().st_size
    envs, insts = [], []
    base = work / "ctx-base"
    base.mkdir()
    shutil.copy(tar, base / "rootfs.tar")
    (base / "Dockerfile").write_text("FROM scratch\nADD rootfs.tar /\n")
    docs = sorted(p for p in Path("/usr/share/doc").iterdir() if p.is_dir())
    for b in range(bases):
        ctx = work / f"ctx-env{b}"
        ctx.mkdir()
        _tree(Path("/usr/lib/python3.11"), ctx / "env", b, 100)
        unique += du(ctx / "env") // (100 if b else 1)  # later bases add their edits only
        (ctx / "Dockerfile").write_text(
            "ARG BASE\nFROM $BASE\n"
            "RUN useradd -m -u 1000 dev && mkdir -p /opt/env && chown dev:dev /opt/env\n"
            "COPY --chown=dev:dev env/ /opt/env/\n"
            f"ENV ENV_ID={b} PATH=/opt/env/bin:/usr/local/bin:/usr/bin:/bin\n")
        envs.append(ctx)
    for i in range(images):
        ctx = work / f"ctx-inst{i}"
        ctx.mkdir()
        start = (i * 7) % max(1, len(docs) - 40)
        (ctx / "repo").mkdir()
        for d in docs[start:start + 40]:
            shutil.copytree(d, ctx / "repo" / d.name, symlinks=True)
        (ctx / "repo" / "task.txt").write_text(f"task {i}\n")
        unique += du(ctx / "repo")  # counted whole: slices overlap, so this is an upper bound
        (ctx / "Dockerfile").write_text(
            "ARG BASE\nFROM $BASE\nCOPY --chown=dev:dev repo/ /testbed/\n"
            "USER dev\nWORKDIR /testbed\n"
            f"RUN echo instance-{i} > /testbed/.instance && ls -R /testbed | wc -l > /tmp/n\n"
            'CMD ["/bin/bash"]\n')
        insts.append(ctx)
    return envs, insts, unique


def _dsec_build(ctx: Path, ref: str, base: str, env: dict[str, str]) -> None:
    args = [os.environ.get("DSEC", str(Path(__file__).parents[1] / ".venv/bin/dsec")),
            "build", str(ctx / "Dockerfile"), "--as", ref]
    if base:
        args += ["--build-arg", f"BASE={base}"]
    subprocess.run(args, check=True, capture_output=True, env=env)


def _buildah(ctx: Path, tag: str, base: str, root: Path) -> None:
    args = ["buildah", "--root", str(root / "root"), "--runroot", str(root / "run"),
            "--storage-driver", "vfs", "bud", "--isolation", "chroot", "--layers",
            "--quiet", "-t", tag]
    if base:
        args += ["--build-arg", f"BASE={base}"]
    subprocess.run([*args, "-f", str(ctx / "Dockerfile"), str(ctx)], check=True,
                   capture_output=True)


def run(bases: int, images: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-dockerfile-", dir="/var/tmp"))
    try:
        envs, insts, unique = _library(work, bases, images)
        env = {**os.environ, "DSEC_STORE": str(work / "store"),
               "DSEC_DATA_DIR": str(work / "data"), "DSEC_STATE_DIR": str(work / "state"),
               "DSEC_CLI_SERVER": "0"}
        out: dict[str, Any] = {"bases": bases, "images": images, "unique_bytes": unique}
        for tool in ("dsec", "buildah"):
            phases: dict[str, float] = {}

            def build(ctx: Path, name: str, base: str) -> None:
                if tool == "dsec":  # noqa: B023 (run at once, within this iteration)
                    _dsec_build(ctx, f"{name}@1", base and f"{base}@1", env)
                else:
                    _buildah(ctx, f"localhost/{name}:1", base and f"localhost/{base}:1", work)

            t = time.perf_counter()
            build(work / "ctx-base", "base", "")
            for b, ctx in enumerate(envs):
                build(ctx, f"env{b}", "base")
            phases["bases_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for i, ctx in enumerate(insts):
                build(ctx, f"inst{i}", f"env{i % bases}")
            phases["instances_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for i, ctx in enumerate(insts):
                build(ctx, f"inst{i}", f"env{i % bases}")
            phases["noop_rebuild_s"] = time.perf_counter() - t
            stored = du(work / "store") if tool == "dsec" else du(work / "root")
            out[tool] = {**phases, "stored_bytes": stored,
                         "stored_vs_unique": round(stored / unique, 3)}
            print(tool, out[tool], flush=True)
        d, b = out["dsec"], out["buildah"]
        out["ratios"] = {k: round(b[k] / d[k], 2) for k in ("bases_s", "instances_s",
                                                          "noop_rebuild_s")}
        out["ratios"]["stored_buildah_over_dsec"] = round(b["stored_bytes"] / d["stored_bytes"],
                                                         2)
        return out
    finally:
        subprocess.run(["umount", "-R", str(work / "root")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bases", type=int, default=4)
    ap.add_argument("--images", type=int, default=20)
    a = ap.parse_args(argv)
    result = run(a.bases, a.images)
    print(save("dockerfile", result))
