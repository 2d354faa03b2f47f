"""A library of images imported in one run (`import_images`, `dsec import A B C`): each
distinct layer is read once, a chunk two layers read side by side share is stored once,
an image that fails leaves the store as it was while the others are imported, and a layer
that took chunks from a layer that failed is read again and comes out whole."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pytest

from dsec_cli.api import images, oci
from dsec_cli.build.layer import ClaimLost, _Writer
from dsec_cli.format.index import ChunkParams
from dsec_cli.push.dedup import KnownChunks
from dsec_cli.push.stores import open_store
from dsec_cli.push.verify import verify

from .conftest import store_files
from .helpers import Image, file, write_layout

BIG = random.Random(11).randbytes(3 << 20)  # incompressible: stored once is 3 MiB, twice 6


def _base(edit: str) -> list:  # type: ignore[type-arg]
    return [file("opt/big.bin", BIG), file("etc/version", edit.encode()),
            *(file(f"usr/lib/m{i}.py", f"# module {i}\n".encode() * 40) for i in range(50))]


def _pack_bytes(env: dict[str, str]) -> int:
    return sum(n for k, n in store_files(env).items() if k.startswith("packs/"))


def test_library_run_reads_each_layer_once_and_stores_shared_chunks_once(
        env: dict[str, str], tmp_path: Path) -> None:
    a = Image([_base("1"), [file("app/a.txt", b"a")]], ["gzip", "none"])
    b = Image([_base("2"), [file("app/b.txt", b"b")]], ["gzip", "zstd"])  # another base
    c = Image([_base("1"), [file("app/c.txt", b"c")]], ["gzip", "gzip"])  # a's base
    for name, img in (("a", a), ("b", b), ("c", c)):
        write_layout(img, tmp_path / name, tag="1")
    seen = []
    run = oci.import_images([str(tmp_path / n) + ":1" for n in "abc"],
                            progress=lambda p: seen.append((p.objects_done, p.bytes_done)))
    assert not run.failed
    assert [r.ref for r in run.reports] == ["a@1", "b@1", "c@1"]
    ra, rb, rc = run.reports
    assert [x.reused for x in rc.layers] == [True, False]  # the base read once, for a
    assert rc.layers[0].manifest == ra.layers[0].manifest
    assert rc.bytes_read < 1000 < ra.bytes_read
    assert seen[-1][0] == 6  # every layer of every image counted once done
    # both bases hold BIG: read side by side, its chunks are compressed and stored once
    assert len(BIG) < _pack_bytes(env) < 1.5 * len(BIG)
    for name in "abc":
        images.export_image(f"{name}@1", tmp_path / f"tree-{name}")
        t = tmp_path / f"tree-{name}"
        assert (t / "opt/big.bin").read_bytes() == BIG
        assert (t / "app" / f"{name}.txt").read_bytes() == name.encode()
    assert (tmp_path / "tree-b/etc/version").read_bytes() == b"2"
    report = verify(open_store(env["DSEC_STORE"]), deep=True)
    assert report.ok, report.problems

    before = store_files(env)
    again = oci.import_images([str(tmp_path / n) + ":1" for n in "abc"])
    assert all(x.reused for r in again.reports for x in r.layers)
    assert [r.manifest for r in again.reports] == [r.manifest for r in run.reports]
    assert store_files(env).keys() == before.keys()


def test_one_bad_image_leaves_the_others_imported(env: dict[str, str], tmp_path: Path,
                                                  run_dsec) -> None:  # type: ignore[no-untyped-def]
    """The middle image's own layer does not match its digest: it is refused with the digest
    named, nothing of it is in the store, and the images around it are imported."""
    base = _base("1")
    write_layout(Image([base, [file("app/a.txt", b"a")]]), tmp_path / "a", tag="1")
    bad = write_layout(Image([base, [file("app/bad.txt", os.urandom(4000))]]),
                       tmp_path / "bad", tag="1", tamper=1)
    write_layout(Image([base, [file("app/c.txt", b"c")]]), tmp_path / "c", tag="1")
    p = run_dsec("import", *(str(tmp_path / n) + ":1" for n in ("a", "bad", "c")), check=2)
    assert json.loads(bad["layers"])[1] in " ".join(p.stderr.split())
    assert "2 of 3 images imported" in p.stdout
    names = {i.ref for i in images.list_images()}
    assert {"a@1", "c@1"} <= names and "bad@1" not in names
    assert verify(open_store(env["DSEC_STORE"]), deep=True).ok
    # the refused layer's bytes went nowhere: a store of a and c alone holds the same packs
    packs = {k for k in store_files(env) if k.startswith("packs/")}
    other = tmp_path / "only"
    oci.import_images([str(tmp_path / "a") + ":1", str(tmp_path / "c") + ":1"],
                      store=other.as_uri())
    assert packs == {str(x.relative_to(other)) for x in (other / "packs").rglob("*")
                     if x.is_file()}


def test_as_names_one_image_only(env: dict[str, str], tmp_path: Path,
                                 run_dsec) -> None:  # type: ignore[no-untyped-def]
    write_layout(Image([[file("x", b"x")]]), tmp_path / "a")
    p = run_dsec("import", str(tmp_path / "a"), str(tmp_path / "a"), "--as", "x@1", check=2)
    assert "--as names one image" in p.stderr
    assert not any(k.startswith(("refs/", "packs/")) for k in store_files(env))


def test_layer_that_took_chunks_from_a_failed_layer_is_read_again(
        env: dict[str, str], tmp_path: Path) -> None:
    """Image a's layer holds BIG first and lies about its diff_id; b's holds other bytes,
    then BIG. Read side by side, b's layer meets BIG's chunks after a's has claimed them;
    a's layer then fails its diff_id check, b's is read again alone and comes out whole."""
    lay = tmp_path / "a"
    write_layout(Image([[file("big.bin", BIG)]]), lay, tag="1")
    index = json.loads((lay / "index.json").read_text())
    blobs = lay / "blobs/sha256"
    mdoc = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    config = json.loads((blobs / mdoc["config"]["digest"][7:]).read_text())
    config["rootfs"]["diff_ids"] = ["sha256:" + "0" * 64]
    cdata = json.dumps(config).encode()
    import hashlib

    cd = hashlib.sha256(cdata).hexdigest()
    (blobs / cd).write_bytes(cdata)
    mdoc["config"] = {**mdoc["config"], "digest": f"sha256:{cd}", "size": len(cdata)}
    mdata = json.dumps(mdoc).encode()
    md = hashlib.sha256(mdata).hexdigest()
    (blobs / md).write_bytes(mdata)
    index["manifests"][0].update(digest=f"sha256:{md}", size=len(mdata))
    (lay / "index.json").write_text(json.dumps(index))
    write_layout(Image([[file("aaa.bin", random.Random(2).randbytes(2 << 20)),
                         file("big.bin", BIG)]]), tmp_path / "b", tag="1")

    run = oci.import_images([str(lay) + ":1", str(tmp_path / "b") + ":1"])
    assert [s for s, _ in run.failed] == [str(lay) + ":1"]
    assert "diff_id" in run.failed[0][1].message
    assert [r.ref for r in run.reports] == ["b@1"]
    images.export_image("b@1", tmp_path / "tree")
    assert (tmp_path / "tree/big.bin").read_bytes() == BIG
    assert verify(open_store(env["DSEC_STORE"]), deep=True).ok


def test_a_claim_on_a_failed_writer_is_lost_and_given_up(tmp_path: Path) -> None:
    """Two writers of one run meet the same chunk: the second takes it from the first once
    it has sealed; when the first fails instead, the second's claim is lost, and the first
    gives its claims up for later writers."""
    store = open_store((tmp_path / "s").as_uri())
    claims: dict = {}  # type: ignore[type-arg]
    params = ChunkParams()
    data = random.Random(4).randbytes(100_000)

    def writer() -> _Writer:
        d = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        return _Writer(store, KnownChunks(), params, d, None, False, defer_uploads=True,
                       claims=claims)

    first, second = writer(), writer()
    first.chunk(data)
    second.chunk(data)
    assert len(second.claimed) == 1 and second.new_chunks == 0
    raised: list[BaseException] = []

    def take() -> None:
        try:
            second.take_claimed()
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    waiting = threading.Thread(target=take)
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and not raised  # it waits for the first to seal
    first.seal_done(False)
    waiting.join(5)
    assert not waiting.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], ClaimLost)
    assert not claims  # given up: a third writer compresses the chunk itself
    third = writer()
    third.chunk(data)
    assert not third.claimed

    ok_claims: dict = {}  # type: ignore[type-arg]
    claims = ok_claims
    owner, taker = writer(), writer()
    owner.chunk(data)
    taker.chunk(data)
    owner.seal_all()
    owner.seal_done(True)
    taker.take_claimed()
    loc = taker.locs[0]
    assert loc is not None and taker.packs[loc.pack] == owner.written[0]
    for w in (first, second, third, owner, taker):
        w.abort()


def test_a_later_wave_takes_no_chunks_from_an_image_that_failed(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One image per wave: the first image's base is read and verified but its own
    application layer is not, so nothing of it is published; the second image's base holds
    the same big file, and must store it again rather than name the packs thrown away."""
    from dsec_cli.build import ociimport

    monkeypatch.setattr(ociimport, "WAVE_IMAGES", 1)
    write_layout(Image([[file("opt/big.bin", BIG)], [file("app/x", os.urandom(5000))]]),
                 tmp_path / "bad", tag="1", tamper=1)
    write_layout(Image([[file("opt/big.bin", BIG), file("etc/other", b"other")]]),
                 tmp_path / "good", tag="1")
    seen = []
    run = oci.import_images([str(tmp_path / "bad") + ":1", str(tmp_path / "good") + ":1"],
                            progress=lambda p: seen.append(p.objects_total))
    assert [s for s, _ in run.failed] == [str(tmp_path / "bad") + ":1"]
    assert [r.ref for r in run.reports] == ["good@1"]
    assert seen[-1] == 3  # one progress for the run, across its waves
    assert verify(open_store(env["DSEC_STORE"]), deep=True).ok
    images.export_image("good@1", tmp_path / "tree")
    assert (tmp_path / "tree/opt/big.bin").read_bytes() == BIG
