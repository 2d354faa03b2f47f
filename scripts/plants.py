#!/usr/bin/env python3
"""Planted bugs, runnable on demand: proof that the tests of the walls can fail.

Each plant removes one guarantee from a copy of the source tree (a text replacement in the
module that enforces it) and runs the tests that claim that guarantee. A plant is *caught*
when those tests fail; *missed* means a test passes with its guarantee gone, i.e. it proves
nothing. The checkout itself is never modified.

    scripts/plants.py --list              the plants and the tests that must catch them
    scripts/plants.py                     run every plant (needs root, as the suite does)
    scripts/plants.py pids-limit lease    run some
    scripts/plants.py --baseline NAME     run NAME's tests on the unmodified copy (must pass)

Exit code 0 when every plant run was caught (or, with --baseline, every run passed).
docs/testing.md describes each plant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plant:
    what: str  # the guarantee removed
    edits: tuple[tuple[str, str, str], ...]  # (file, exact old text, new text)
    tests: tuple[str, ...]  # pytest node ids that must fail


PLANTS: dict[str, Plant] = {
    "pids-limit": Plant(
        "a container sandbox's pids limit is raised to 1024, whatever was asked",
        (("dsec_cli/backends/container.py", 'resources["pids"] = {"limit": lim.pids}',
          'resources["pids"] = {"limit": 1024}'),),
        ("tests/run/test_isolation.py::test_memory_hog_and_fork_bomb_are_contained",)),
    "network-namespace": Plant(
        "a container sandbox with network none shares the host's network",
        (("dsec_cli/backends/container.py", 'if spec.network == "none":\n        namespaces',
          'if False:\n        namespaces'),),
        ("tests/run/test_isolation.py::test_no_network_by_default",)),
    "build-network": Plant(
        "build run steps always share the host's network",
        (("dsec_cli/backends/oneshot.py", "    if network:\n        cmd += [\"--share-net\"]",
          "    if True:\n        cmd += [\"--share-net\"]"),),
        ("tests/build/test_promises.py::test_run_steps_have_network_only_when_asked",)),
    "sandbox-pin": Plant(
        "a sandbox's pin is never written, so gc may delete the image it runs",
        (("dsec_cli/run/pins.py",
          "        store.put(pin_key(node_id, sid), json.dumps(doc).encode())",
          "        pass"),),
        ("tests/run/test_promises.py::test_sandbox_pin_keeps_its_image_through_rmi_and_gc",)),
    "container-caps": Plant(
        "a container sandbox keeps CAP_SYS_ADMIN and may gain privileges",
        (("dsec_cli/backends/container.py", '"CAP_KILL", "CAP_AUDIT_WRITE"]',
          '"CAP_KILL", "CAP_AUDIT_WRITE", "CAP_SYS_ADMIN"]'),
         ("dsec_cli/backends/container.py", '"noNewPrivileges": True',
          '"noNewPrivileges": False')),
        ("tests/run/test_promises.py::test_container_hardening",)),
    "masked-proc": Plant(
        "a container sandbox sees the host's /proc/keys, /proc/timer_list and /proc/acpi",
        (("dsec_cli/backends/container.py", '"maskedPaths": MASKED,', '"maskedPaths": [],'),),
        ("tests/run/test_promises.py::test_container_hardening",)),
    "device-cgroup": Plant(
        "a container sandbox's device cgroup allows every device",
        (("dsec_cli/backends/container.py",
          'resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}',
          'resources: dict[str, Any] = {"devices": [{"allow": True, "access": "rwm"}]}'),),
        ("tests/run/test_promises.py::test_container_hardening",)),
    "oci-no-retry": Plant(
        "an OCI registry's 429 and 5xx answers are not retried",
        (("dsec_cli/push/stores/oci.py", "            return TransientStoreError(msg)\n"
          "        if r.status_code in (401, 403):",
          "            return StoreError(msg)\n        if r.status_code in (401, 403):"),),
        ("tests/push/test_promises.py::test_transient_errors_are_retried_until_the_push_succeeds",)),
    "oci-auth-retried": Plant(
        "an OCI registry's 401 and 403 answers are retried as if transient",
        (("dsec_cli/push/stores/oci.py",
          "        if r.status_code == 429 or r.status_code >= 500:\n"
          "            return TransientStoreError(msg)",
          "        if r.status_code in (401, 403, 429) or r.status_code >= 500:\n"
          "            return TransientStoreError(msg)"),),
        ("tests/push/test_promises.py::test_auth_errors_are_not_retried",)),
    "create-resent": Plant(
        "a cluster create whose reply was lost is sent again",
        (("dsec_cli/run/cluster/remote.py",
          'IDEMPOTENT = frozenset({"hello", "info", "lookup", "describe", "get", "ps"})',
          'IDEMPOTENT = frozenset({"hello", "info", "lookup", "describe", "get", "ps", '
          '"create"})'),),
        ("tests/cluster/test_protocol.py::test_create_is_never_sent_again_after_a_lost_reply",)),
    "repack-overwrites": Plant(
        "repack moves a ref another client changed meanwhile",
        (("dsec_cli/push/repack.py", "            if current != r.manifest:",
          "            if False:"),),
        ("tests/push/test_repack.py::test_ref_moved_meanwhile_is_skipped_not_overwritten",)),
    "s3-multipart": Plant(
        "S3 uploads of 64 MiB and more are sent in one request",
        (("dsec_cli/push/stores/s3.py", "MULTIPART_THRESHOLD = 64 << 20",
          "MULTIPART_THRESHOLD = 1 << 40"),),
        ("tests/push/test_promises.py::test_s3_uploads_of_64_mib_and_more_are_multipart",)),
    "seccomp-list": Plant(
        "the seccomp deny list loses unshare, setns and the mount calls",
        (("dsec_cli/backends/seccomp.py",
          '"setns": 308, "unshare": 272,', ""),
         ("dsec_cli/backends/seccomp.py",
          '"mount": 165, "umount2": 166, "pivot_root": 155, ', "")),
        ("tests/security/test_walls.py::test_seccomp_denies_in_sandboxes",
         "tests/security/test_walls.py::test_seccomp_in_build_steps",
         "tests/security/test_walls.py::test_seccomp_in_function_pool")),
    "lease": Plant(
        "store gc ignores live writer leases",
        (("dsec_cli/push/gc.py", "live_leases = [le for le in read_leases(store) if le.live()]",
          "live_leases = []"),
         ("dsec_cli/push/gc.py", "report.leases_live = sum(1 for le in leases if le.live(now))",
          "report.leases_live = 0")),
        ("tests/push/test_gc.py",)),
    "tree-writer": Plant(
        "the tree writer follows symlinks when it opens a parent directory",
        (("dsec_cli/format/tree.py", "_RESOLVE = 0x08 | 0x04 | 0x02 | 0x01", "_RESOLVE = 0"),
         ("dsec_cli/format/tree.py",
          "_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC",
          "_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC")),
        ("tests/security/test_tree_writer.py::test_dir_then_symlink_then_file_below",
         "tests/security/test_tree_writer.py::test_deep_parent_replaced_by_symlink")),
    "lazy-xattrs": Plant(
        "a lazy mount of a layer without xattrs still answers xattr callbacks",
        (("dsec_cli/run/lazy/fs.py", "    getxattr = None  # type: ignore[assignment]\n"
          "    listxattr = None  # type: ignore[assignment]\n", "    pass\n"),),
        ("tests/lazy/test_mount.py::test_layer_without_xattrs_is_served_without_xattr_callbacks",)),
}


def copy_tree(dest: Path) -> None:
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
    shutil.copytree(REPO, dest, symlinks=True,
                    ignore=lambda _d, names: [n for n in names if n in skip])


def apply(root: Path, plant: Plant) -> None:
    for rel, old, new in plant.edits:
        path = root / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"plant out of date: {rel} does not hold exactly one {old!r}")
        path.write_text(text.replace(old, new))


def run(name: str, plant: Plant, baseline: bool) -> bool:
    with tempfile.TemporaryDirectory(prefix=f"dsec-plant-{name}-") as tmp:
        root = Path(tmp) / "src"
        copy_tree(root)
        if not baseline:
            apply(root, plant)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               *plant.tests]
        env = {**os.environ, "PYTHONPATH": str(root)}
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        lines = p.stdout.strip().splitlines()
        why = [ln for ln in lines if ln.startswith("E ")][:2]  # the first failed assertion
        tail = "\n  ".join([*why, *lines[-2:]])
        if baseline:
            ok = p.returncode == 0
            print(f"{name}: baseline {'passes' if ok else 'FAILS'}\n  {tail}")
        else:
            # exit 1: tests ran and some failed; anything else (collection error,
            # interrupted) proves nothing
            ok = p.returncode == 1 and " failed" in p.stdout
            print(f"{name}: {'caught' if ok else 'MISSED'} ({plant.what})\n  {tail}")
        return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="plants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the plants and their tests")
    ap.add_argument("--baseline", action="store_true",
                    help="run the tests without the plant (they must pass)")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in PLANTS]
    if unknown:
        ap.error(f"unknown plant(s) {', '.join(unknown)}; known: {', '.join(PLANTS)}")
    if args.list:
        for name, plant in PLANTS.items():
            print(f"{name}: {plant.what}\n  " + "\n  ".join(plant.tests))
        return 0
    results = [run(n, PLANTS[n], args.baseline) for n in args.names or list(PLANTS)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
