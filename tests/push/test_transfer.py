"""push / pull through real remotes: byte-exact round trips, incremental pushes, interrupted
pushes, corruption and the errors a user meets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec_cli.core.digests import object_key
from dsec_cli.core.errors import IntegrityError, NotFoundError, UsageError
from dsec_cli.format.closure import closure
from dsec_cli.format.refs import get_ref, list_refs
from dsec_cli.push import api
from dsec_cli.push.materialize import export
from dsec_cli.push.stores import open_store
from dsec_cli.push.testing import free_port
from dsec_cli.push.transfer import copy_refs

from .helpers import build_layer, dsec, make_tree, raw_layer, tree_digest


@pytest.mark.parametrize("remote", ["s3", "oci"])
def test_push_pull_round_trip_byte_exact(remote: str, make_url: Callable[[str], str],
                                         tmp_path: Path) -> None:
    src_url, dst_url, far = make_url("file"), make_url("file"), make_url(remote)
    specs = tmp_path / "specs"
    make_tree(specs / "tree", seed=1)
    build_layer(src_url, specs, "data", "1")
    (specs / "img.yaml").write_text('image: app\nversion: "1"\nlayers: [data@1]\n')
    from dsec_cli.build.builder import build

    build([specs / "img.yaml"], src_url)

    out = dsec("push", "app@1", "--to", far, "--store", src_url, "--json")
    assert out.returncode == 0, out.stderr
    pushed = json.loads(out.stdout)
    assert pushed["objects_sent"] == pushed["objects_total"] > 3
    report = api.pull(["app@1"], far, store=dst_url)
    assert report.objects_sent == pushed["objects_total"]

    with open_store(dst_url) as dst:
        export(dst, "app@1", tmp_path / "out")
    assert tree_digest(tmp_path / "out" / "data") == tree_digest(specs / "tree")
    again = api.pull(["app@1"], far, store=dst_url)  # nothing left to send
    assert again.objects_sent == 0 and again.objects_present == again.objects_total


def test_incremental_push_sends_only_new_objects(make_url: Callable[[str], str],
                                                 tmp_path: Path) -> None:
    src_url, far = make_url("file"), make_url("s3")
    specs = tmp_path / "specs"
    tree = make_tree(specs / "tree", seed=2, files=30)
    v1 = build_layer(src_url, specs, "data", "1")
    first = api.push(["data@1"], far, store=src_url)
    (tree / "d1" / "f1.bin").write_bytes(os.urandom(4000))  # a small change
    v2 = build_layer(src_url, specs, "data", "2")
    second = api.push(["data@2"], far, store=src_url)
    with open_store(src_url) as src:
        new = set(closure(src, v2)) - set(closure(src, v1))
    assert second.objects_sent == len(new)
    assert 0 < second.objects_sent < second.objects_total
    assert second.bytes_sent < first.bytes_sent / 4


KILLER = textwrap.dedent("""
    import os, signal, sys
    from dsec_cli.push.stores import open_store
    from dsec_cli.push.transfer import copy_refs
    def progress(p):
        if p.objects_done >= 3:
            os.kill(os.getpid(), signal.SIGKILL)
    copy_refs(open_store(sys.argv[1]), open_store(sys.argv[2]), ["big@1"], jobs=1,
              progress=progress)
""")


def test_push_killed_midway_publishes_nothing_and_rerun_completes(
        make_url: Callable[[str], str]) -> None:
    src_url, far = make_url("file"), make_url("s3")
    with open_store(src_url) as src:
        raw_layer(src, "big", "1", [os.urandom(200_000) for _ in range(8)])
        keys = closure(src, get_ref(src, "big@1").manifest)
    proc = subprocess.run([sys.executable, "-c", KILLER, src_url, far], timeout=120)
    assert proc.returncode == -9  # SIGKILL, midway
    with open_store(far) as dst:
        with pytest.raises(NotFoundError):
            get_ref(dst, "big@1")
        present = [k for k in keys if dst.has(k)]
        assert 3 <= len(present) < len(keys)
        with open_store(src_url) as src:
            report = copy_refs(src, dst, ["big@1"])
        assert report.objects_sent == len(keys) - len(present)
        assert get_ref(dst, "big@1").manifest == keys[-1].rsplit("/", 1)[1]


def test_corrupted_object_is_detected_on_pull(make_url: Callable[[str], str]) -> None:
    far, local = make_url("s3"), make_url("file")
    with open_store(far) as remote:
        raw_layer(remote, "lib", "1", [os.urandom(50_000), os.urandom(50_000)])
        pack = next(k for k in closure(remote, get_ref(remote, "lib@1").manifest)
                    if k.startswith("packs/"))
        data = bytearray(remote.get(pack))
        data[100] ^= 0xFF  # one flipped bit in the remote copy
        remote.put(pack, bytes(data))
    with pytest.raises(IntegrityError, match="corrupt"):
        api.pull(["lib@1"], far, store=local)
    with open_store(local) as dst:
        with pytest.raises(NotFoundError):
            get_ref(dst, "lib@1")
    out = dsec("pull", "lib@1", "--from", far, "--store", local)
    assert out.returncode == 2 and "corrupt" in out.stderr  # a corrupt object is bad input


def test_unreachable_server_is_a_clear_runtime_error(make_url: Callable[[str], str]) -> None:
    local = make_url("file")
    with open_store(local) as src:
        raw_layer(src, "x", "1", [b"payload"])
    dead = f"127.0.0.1:{free_port()}"
    for url in (f"s3://bucket1?endpoint_url=http://{dead}", f"oci://{dead}/repo?insecure=1"):
        out = dsec("push", "x@1", "--to", url, "--store", local,
                   env={"DSEC_STORE_RETRIES": "2"})
        assert out.returncode == 1, out.stderr
        assert "still failing after 2 attempts" in out.stderr and dead in out.stderr
        assert "Traceback" not in out.stderr


def test_bad_urls_and_missing_bucket_are_usage_errors(make_url: Callable[[str], str],
                                                      s3_server: str) -> None:
    local = make_url("file")
    with open_store(local) as src:
        raw_layer(src, "x", "1", [b"payload"])
    cases = {
        "s3://": "names no bucket",
        "s3://Bad_Bucket": "not a valid S3 bucket name",
        "oci://registry.example": "needs a registry and a repository",
        "oci://127.0.0.1:1/UPPER": "not a valid OCI repository name",
        "ftp://somewhere/x": "unknown store URL scheme",
        f"s3://no-such-bucket-here?endpoint_url={s3_server}": "does not exist",
    }
    for url, message in cases.items():  # the SDK raises the usage error...
        with pytest.raises(UsageError, match=message):
            api.push(["x@1"], url, store=local)
    for url in ("s3://", f"s3://no-such-bucket-here?endpoint_url={s3_server}"):  # ...exit 2
        out = dsec("push", "x@1", "--to", url, "--store", local)
        assert out.returncode == 2 and cases[url] in out.stderr, (url, out.stderr)
    out = dsec("push", "nope@1", "--to", make_url("s3"), "--store", local)
    assert out.returncode == 2 and "no layer or image nope@1" in out.stderr


def test_rmi_removes_refs_only_after_checking_all(make_url: Callable[[str], str]) -> None:
    url = make_url("oci")
    with open_store(url) as s:
        raw_layer(s, "a", "1", [b"one"])
        raw_layer(s, "b", "1", [b"two"])
    out = dsec("rmi", "a@1", "zzz@1", "--store", url)
    assert out.returncode == 2 and "zzz@1" in out.stderr, out.stderr
    with open_store(url) as s:  # nothing removed: a@1 is checked with the missing ref
        assert sorted(r.ref for r in list_refs(s)) == ["a@1", "b@1"]
    out = dsec("rmi", "a@1", "--store", url, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)[0]["ref"] == "a@1"
    with open_store(url) as s:
        assert [r.ref for r in __import__("dsec_cli.format.refs").format.refs.list_refs(s)] \
            == ["b@1"]
        assert s.has(object_key("packs", __import__("hashlib").sha256(b"one").hexdigest()))
