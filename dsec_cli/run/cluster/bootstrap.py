"""Install this dsec on a node that lacks it, over the node's SSH connection, with nothing
from the network: the files of dsec and of every distribution it requires are streamed from
this machine's environment as one tar into ``<install dir>/site`` on the node, next to a
``bin/dsec`` launcher for the node's python3. Pure-Python and compiled packages alike are
copied as installed, so the node must have the same Python version and machine type as this
one (checked first, and refused with a clear message otherwise).
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import tarfile
from dataclasses import replace
from importlib import metadata
from pathlib import Path

from ... import __version__
from ...core.errors import UsageError
from .errors import NodeCommandError
from .remote import NodeEntry
from .ssh import classify

log = logging.getLogger(__name__)

DEFAULT_DIR = f"$HOME/.local/share/dsec/bootstrap/{__version__}"
_PROBE = ("import sys, platform, json; "
          "print(json.dumps([list(sys.version_info[:2]), platform.machine()]))")


def _requirements(dist: str, seen: set[str]) -> None:
    """The distribution closure of ``dist`` (runtime requirements only, no extras)."""
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return
    for r in reqs:
        if "extra ==" in r:
            continue
        marker_ok = True
        if ";" in r:  # environment markers: evaluated by pip's vendored packaging
            try:
                from pip._vendor.packaging.requirements import Requirement

                marker = Requirement(r).marker
                marker_ok = marker is None or marker.evaluate()
            except Exception:  # no pip here: keep the requirement (extra files are harmless)
                marker_ok = True
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9_.-]*", r)
        if marker_ok and m:
            name = re.sub(r"[-_.]+", "-", m.group(0)).lower()
            if name not in seen:
                seen.add(name)
                _requirements(name, seen)


def payload() -> bytes:
    """A tar of dsec_cli (with its compiled sandbox agent) and its dependencies' files."""
    deps: set[str] = set()
    _requirements("dsec", deps)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        pkg = Path(__file__).resolve().parents[2]  # dsec_cli/ (this is dsec_cli/run/cluster/)
        tar.add(pkg, arcname="dsec_cli",
                filter=lambda ti: None if "__pycache__" in ti.name else ti)
        for name in sorted(deps):
            dist = metadata.distribution(name)
            for f in dist.files or []:
                if str(f).startswith("..") or "__pycache__" in str(f):
                    continue
                src = Path(str(dist.locate_file(f)))
                if src.is_file():
                    tar.add(src, arcname=str(f))
    return buf.getvalue()


def _ssh(entry: NodeEntry, script: str, data: bytes | None = None) -> str:
    p = subprocess.run(entry.target.command_argv(["sh", "-c", script]), input=data,
                       capture_output=True, timeout=300)
    if p.returncode == 255:
        raise classify(entry.name, p.stderr.decode(errors="replace"))
    if p.returncode != 0:
        raise NodeCommandError(f"{entry.name}: bootstrap step failed ({p.returncode}): "
                               f"{p.stderr.decode(errors='replace').strip()[-500:]}")
    return p.stdout.decode()


def bootstrap(entry: NodeEntry, install_dir: str = DEFAULT_DIR) -> NodeEntry:
    """Install dsec on the node; returns the entry with ``dsec`` pointing at it."""
    import platform

    if "'" in install_dir or "\n" in install_dir:
        raise UsageError(f"invalid install dir {install_dir!r}")
    entry.target.ensure_master(entry.name)
    try:
        remote = json.loads(_ssh(entry, f"python3 -c '{_PROBE}'").strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        raise NodeCommandError(f"{entry.name}: cannot run python3 there") from e
    here = [list(sys.version_info[:2]), platform.machine()]
    if remote != here:
        raise NodeCommandError(
            f"{entry.name}: has Python {remote[0]} on {remote[1]}, this machine "
            f"{here[0]} on {here[1]}: the installed packages cannot be copied",
            hint="install dsec there with pip and give its path with --dsec")
    script = f"""set -e
d="{install_dir}"
rm -rf "$d.new"
mkdir -p "$d.new/site" "$d.new/bin"
tar -xz -C "$d.new/site"
cat > "$d.new/bin/dsec" <<'LAUNCHER'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
PYTHONPATH="$here/../site" exec python3 -s -c 'from dsec_cli.cli import main; main()' "$@"
LAUNCHER
chmod 755 "$d.new/bin/dsec"
rm -rf "$d"
mv "$d.new" "$d"
cd "$d" && pwd
"""
    where = _ssh(entry, script, payload()).strip().splitlines()[-1]
    log.info("installed dsec on %s at %s", entry.name, where)
    return replace(entry, dsec=f"{where}/bin/dsec")
