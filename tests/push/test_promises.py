"""What docs/stores.md promises of push, pull and gc, through the real `dsec` script and real
servers: --endpoint-url, AWS_ENDPOINT_URL, -j, --insecure; transient errors (429, 5xx) retried
until the transfer succeeds, and 401/403 never retried; gc on an OCI registry."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec_cli.format.closure import closure
from dsec_cli.format.refs import list_refs
from dsec_cli.push import testing
from dsec_cli.push.materialize import export
from dsec_cli.push.stores import open_store

from ..flakyproxy import FlakyProxy
from .helpers import build_layer, dsec, make_tree, raw_layer, tree_digest


def oci_request(method: str, path: str) -> str:
    """A blob upload's retry starts a new upload session: the same request, by its digest."""
    import re
    from urllib.parse import parse_qs, urlsplit

    u = urlsplit(path)
    p = re.sub(r"/blobs/uploads/[^/]+$", "/blobs/uploads/*", u.path)
    return p + "?" + ",".join(parse_qs(u.query).get("digest", []))


@pytest.fixture
def local(make_url: Callable[[str], str], tmp_path: Path) -> tuple[str, Path]:
    """A file store holding data@1, built from a tree of several files."""
    url = make_url("file")
    specs = tmp_path / "specs"
    make_tree(specs / "tree", seed=4)
    build_layer(url, specs, "data", "1")
    return url, specs / "tree"


def _pulled_tree(url: str, tmp_path: Path) -> dict[str, str]:
    out = tmp_path / f"out-{uuid.uuid4().hex[:6]}"
    with open_store(url) as st:
        export(st, "data@1", out)
    return tree_digest(out / "data")


def test_s3_endpoint_from_flag_and_from_aws_endpoint_url(local: tuple[str, Path],
                                                         s3_server: str,
                                                         make_url: Callable[[str], str],
                                                         tmp_path: Path) -> None:
    src, tree = local
    bucket = f"e{uuid.uuid4().hex[:12]}"
    testing.create_bucket(s3_server, bucket)
    far = f"s3://{bucket}/pre"  # no endpoint in the URL: the flag or the variable gives it
    out = dsec("push", "data@1", "--to", far, "--store", src, "--endpoint-url", s3_server,
               "-j", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["objects_sent"] > 0
    dst = make_url("file")
    out = dsec("pull", "data@1", "--from", far, "--store", dst, "-j", "3",
               env={"AWS_ENDPOINT_URL": s3_server})
    assert out.returncode == 0, out.stderr
    assert _pulled_tree(dst, tmp_path) == tree_digest(tree)
    # without either, the URL means AWS itself, which this machine cannot reach: no object
    # of the test's bucket is reached that way (the push fails, naming the store)
    out = dsec("push", "data@1", "--to", far, "--store", src,
               env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert out.returncode != 0 and bucket in out.stderr, out.stderr


def test_jobs_out_of_range_is_refused(local: tuple[str, Path], make_url: Callable[[str], str]
                                      ) -> None:
    src, _ = local
    dst = make_url("file")
    out = dsec("push", "data@1", "--to", dst, "--store", src, "-j", "0")
    assert out.returncode == 2 and "-j" in out.stderr or "--jobs" in out.stderr, out.stderr
    with open_store(dst) as st:
        assert list_refs(st) == []


def test_oci_insecure_flag(local: tuple[str, Path], registry: str,
                           make_url: Callable[[str], str], tmp_path: Path) -> None:
    src, tree = local
    far = f"oci://{registry}/dsec/i{uuid.uuid4().hex[:10]}"  # plain HTTP only with --insecure
    out = dsec("push", "data@1", "--to", far, "--store", src)
    assert out.returncode != 0 and registry in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    out = dsec("push", "data@1", "--to", far, "--store", src, "--insecure")
    assert out.returncode == 0, out.stderr
    dst = make_url("file")
    out = dsec("pull", "data@1", "--from", far, "--store", dst, "--insecure")
    assert out.returncode == 0, out.stderr
    assert _pulled_tree(dst, tmp_path) == tree_digest(tree)


@pytest.mark.parametrize("kind,status", [("s3", 500), ("s3", 429), ("oci", 503),
                                         ("oci", 429)])
def test_transient_errors_are_retried_until_the_push_succeeds(
        kind: str, status: int, local: tuple[str, Path], s3_server: str, registry: str,
        make_url: Callable[[str], str], tmp_path: Path) -> None:
    src, tree = local
    if kind == "s3":
        bucket = f"f{uuid.uuid4().hex[:12]}"
        testing.create_bucket(s3_server, bucket)
        proxy = FlakyProxy(s3_server, status=status)
        far = f"s3://{bucket}/pre?endpoint_url={proxy.url}"
    else:
        # one failure per request: an OCI write is several requests (upload, manifest),
        # each met by the failures of its own
        proxy = FlakyProxy(f"http://{registry}", failures=1, status=status, key=oci_request)
        far = f"oci://{proxy.url.removeprefix('http://')}/dsec/f{uuid.uuid4().hex[:8]}?insecure=1"
    try:
        out = dsec("push", "data@1", "--to", far, "--store", src,
                   env={"DSEC_STORE_RETRIES": "10"})
        assert out.returncode == 0, out.stderr
        assert proxy.failed > 3 and proxy.forwarded > 0  # each request met its failures
        dst = make_url("file")
        out = dsec("pull", "data@1", "--from", far, "--store", dst,
                   env={"DSEC_STORE_RETRIES": "10"})
        assert out.returncode == 0, out.stderr
        assert _pulled_tree(dst, tmp_path) == tree_digest(tree)
    finally:
        proxy.stop()


@pytest.mark.parametrize("kind,status", [("s3", 403), ("oci", 403), ("oci", 401)])
def test_auth_errors_are_not_retried(kind: str, status: int, local: tuple[str, Path],
                                     s3_server: str, registry: str) -> None:
    src, _ = local
    if kind == "s3":
        bucket = f"a{uuid.uuid4().hex[:12]}"
        testing.create_bucket(s3_server, bucket)
        proxy = FlakyProxy(s3_server, failures=1 << 30, status=status)
        far = f"s3://{bucket}/pre?endpoint_url={proxy.url}"
    else:
        proxy = FlakyProxy(f"http://{registry}", failures=1 << 30, status=status)
        far = f"oci://{proxy.url.removeprefix('http://')}/dsec/a{uuid.uuid4().hex[:8]}?insecure=1"
    try:
        out = dsec("push", "data@1", "--to", far, "--store", src, env={"DSEC_STORE_RETRIES": "5"})
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert proxy.forwarded == 0 and proxy.failed >= 1
        # no request was tried again
        assert max(proxy.tries.values()) == 1, proxy.tries
        if kind == "oci":  # the error says where credentials come from
            assert "docker login" in out.stderr, out.stderr
    finally:
        proxy.stop()


def test_gc_on_an_oci_registry(make_url: Callable[[str], str]) -> None:
    """docs/stores.md: on OCI, gc removes expired leases and stale state, never a blob a ref
    reaches (orphans are left to the registry's own collector)."""
    import time

    url = make_url("oci")
    with open_store(url) as s:
        keep = raw_layer(s, "keep", "1", [os.urandom(2000)])
        raw_layer(s, "drop", "1", [os.urandom(2000)])
        live = set(closure(s, keep))
        old = time.time() - 7200
        s.put("leases/expired", json.dumps({"purpose": "push", "holder": "gone:1",
                                            "started": old, "expires": old + 60}).encode())
    out = dsec("rmi", "drop@1", "--store", url)
    assert out.returncode == 0, out.stderr
    out = dsec("gc", "--store", url, "--grace", "0", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)["store"]
    assert report["leases_removed"] == 1 and report["refs"] == 1, report
    assert report["reachable"] == len(live) and report["deleted"] == [], report
    with open_store(url) as s:
        assert [r.ref for r in list_refs(s)] == ["keep@1"]
        assert all(s.has(k) for k in live)
        assert [i.key for i in s.list("leases/")] == []


def test_s3_uploads_of_64_mib_and_more_are_multipart(make_url: Callable[[str], str],
                                                      tmp_path: Path) -> None:
    """docs/stores.md: an upload of 64 MiB or more (and put_file) is a multipart upload (its
    ETag ends in -<parts>); it reads back byte for byte, across part boundaries too."""
    import boto3

    url = make_url("s3")
    bucket, endpoint = url[5:].split("/")[0], url.split("endpoint_url=")[1]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    data = os.urandom(1 << 20) * 65  # 65 MiB
    small = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    with open_store(url) as st:
        st.put("packs/aa/big", data)
        st.put("packs/aa/small", small)
        st.put_file("packs/aa/file", tmp_path / "f")
        assert st.get("packs/aa/big") == data and st.get("packs/aa/file") == data
        cut = 16 << 20  # a part boundary
        assert st.get("packs/aa/big", cut - 10, 20) == data[cut - 10:cut + 10]
    etags = {k: s3.head_object(Bucket=bucket, Key=f"pre/packs/aa/{k}")["ETag"].strip('"')
             for k in ("big", "small", "file")}
    assert etags["big"].endswith("-5") and etags["file"].endswith("-5"), etags
    assert "-" not in etags["small"], etags


def test_oci_credentials_come_from_the_docker_config(local: tuple[str, Path], registry: str,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry that requires a login (token flow): without credentials the push fails
    with the docker login hint; with them in ~/.docker/config.json it succeeds; with wrong
    ones it fails again."""
    import base64

    src, _ = local
    proxy = FlakyProxy(f"http://{registry}", failures=0, basic_auth="dsec:s3cret")
    host = proxy.url.removeprefix("http://")
    far = f"oci://{host}/dsec/auth{uuid.uuid4().hex[:8]}?insecure=1"
    docker = tmp_path / "home" / ".docker"
    docker.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # never the user's own credentials
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)  # the default place: ~/.docker
    try:
        out = dsec("push", "data@1", "--to", far, "--store", src)
        assert out.returncode != 0 and "docker login" in out.stderr, out.stderr
        assert proxy.unauthorized >= 1 and proxy.forwarded == 0
        (docker / "config.json").write_text(json.dumps(
            {"auths": {host: {"auth": base64.b64encode(b"dsec:s3cret").decode()}}}))
        out = dsec("push", "data@1", "--to", far, "--store", src, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["objects_sent"] > 0 and proxy.forwarded > 0
        (docker / "config.json").write_text(json.dumps(
            {"auths": {host: {"auth": base64.b64encode(b"dsec:wrong").decode()}}}))
        out = dsec("push", "data@1", "--to", far, "--store", src)
        assert out.returncode != 0 and "docker login" in out.stderr, out.stderr
    finally:
        proxy.stop()


def test_reading_a_typoed_file_store_is_an_error_and_creates_nothing(
        local: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = local
    typo = tmp_path / "no" / "such-store"
    for argv in (["ls"], ["verify"], ["gc"], ["inspect", "data@1"], ["rmi", "data@1"],
                 ["push", "data@1", "--to", url], ["export", "data@1", str(tmp_path / "x")]):
        p = dsec(*argv, "--store", typo.as_uri())
        assert p.returncode == 2, (argv, p)
        assert f"no store at {typo}" in p.stderr and "Traceback" not in p.stderr, (argv, p)
    p = dsec("pull", "data@1", "--from", typo.as_uri(), "--store", url)
    assert p.returncode == 2 and f"no store at {typo}" in p.stderr, p
    assert not (tmp_path / "no").exists()
    # the built-in default store reads as empty before anything was built into it
    fresh = {"DSEC_DATA_DIR": str(tmp_path / "fresh"), "DSEC_CONFIG": str(tmp_path / "c.yaml")}
    env = {k: v for k, v in os.environ.items() if k != "DSEC_STORE"}
    import subprocess

    from .helpers import DSEC

    p = subprocess.run([DSEC, "ls", "--json"], capture_output=True, text=True,
                       env={**env, **fresh}, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout) == [], p
    assert not (tmp_path / "fresh").exists()
    # a writer makes the store: pull into a new path
    new = tmp_path / "new-store"
    assert dsec("pull", "data@1", "--from", url, "--store", new.as_uri()).returncode == 0
    assert json.loads(dsec("ls", "--json", "--store", new.as_uri()).stdout)[0]["ref"] == "data@1"


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_store_objects_follow_the_umask(umask: int, tmp_path: Path) -> None:
    """A store written by root is readable by the users it is shared with: every object
    (packs included, which are written to a temporary file and linked in) has the mode the
    umask leaves of 0666, as git and restic write theirs."""
    import subprocess

    from .helpers import DSEC, write_spec

    specs = tmp_path / "specs"
    make_tree(specs / "tree", seed=5)
    spec = write_spec(specs, "shared", "1")
    store = tmp_path / "store"
    subprocess.run(["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", DSEC, "build",
                    str(spec), "--store", store.as_uri()], check=True, capture_output=True,
                   timeout=300)
    modes = {}
    for dirpath, _, names in os.walk(store):
        for n in names:
            if not dirpath.startswith(str(store / "tmp")):
                p = Path(dirpath, n)
                modes[str(p.relative_to(store))] = p.stat().st_mode & 0o777
    assert any(k.startswith("packs/") for k in modes), modes
    wrong = {k: oct(m) for k, m in modes.items() if m != 0o666 & ~umask}
    assert not wrong, wrong
