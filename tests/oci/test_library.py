"""A library of images imported in one run (`import_images`, `dsec import A B C`): each
distinct layer is read once, a chunk two layers read side by side share is stored once,
an image that fails leaves the store as it was while the others are imported, and a layer
that took chunks from a layer that failed is read again and comes out whole."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
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
from .helpers import Image, base_image, file, skopeo, write_layout

BIG = random.Random(11).randbytes(3 << 20)  # incompressible: stored once is 3 MiB, twice 6


def _base(edit: str) -> list:  # type: ignore[type-arg]
    return [file("opt/big.bin", BIG), file("etc/version", edit.encode()),
            *(file(f"usr/lib/m{i}.py", f"# module {i}\n".encode() * 40) for i in range(50))]


def _pack_bytes(env: dict[str, str]) -> int:
    return sum(n for k, n in store_files(env).items() if k.startswith("packs/"))


def _refuse_batches(monkeypatch: pytest.MonkeyPatch, sources: list[Path],
                    refuse: int) -> list[tuple[int, bool]]:
    """The file store's batch commit, watched: for each batch holding the image manifests
    of some of ``sources`` (an image's manifest names its source), how many, and whether
    it was refused; a batch holding at least ``refuse`` of them is refused (its files
    removed, nothing shown), as a full disk would."""
    from dsec_cli.core.errors import StoreError
    from dsec_cli.push.stores.file import FileStore

    commit = FileStore._commit_batch
    names = [json.dumps(str(x) + ":1").encode() for x in sources]
    seen: list[tuple[int, bool]] = []

    def watched(self, batch):  # type: ignore[no-untyped-def]
        held = sum(any(x in tmp.read_bytes() for tmp, key in batch
                       if key.startswith("manifests/")) for x in names)
        if held:
            seen.append((held, held >= refuse))
        if held and held >= refuse:
            for tmp, _ in batch:
                tmp.unlink(missing_ok=True)
            raise StoreError("writing a batch: the disk is full (refused in this test)")
        return commit(self, batch)

    monkeypatch.setattr(FileStore, "_commit_batch", watched)
    return seen


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


def _hold_plans(monkeypatch: pytest.MonkeyPatch, held: str, until: threading.Event,
                seen: list[bool]) -> None:
    """The plan of the source ``held`` waits (at most 10 s) for ``until``; ``seen`` records
    whether it came in time."""
    from dsec_cli.build import ociimport

    plan = ociimport._plan

    def held_plan(store, source_text, *a, **kw):  # type: ignore[no-untyped-def]
        if source_text.startswith(held):
            seen.append(until.wait(10))
        return plan(store, source_text, *a, **kw)

    monkeypatch.setattr(ociimport, "_plan", held_plan)


def test_an_images_layers_are_read_while_later_images_are_planned(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second image's manifest is not read until the first image's layer is being
    read: the run starts each image's layers once that image is planned."""
    from dsec_cli.build import ociimport

    write_layout(Image([[file("a.bin", BIG)]]), tmp_path / "a", tag="1")
    write_layout(Image([[file("b.txt", b"b")]]), tmp_path / "b", tag="1")
    reading = threading.Event()
    stage = ociimport.schedule.stage_layer

    def staged(*a, **kw):  # type: ignore[no-untyped-def]
        reading.set()
        return stage(*a, **kw)

    monkeypatch.setattr(ociimport.schedule, "stage_layer", staged)
    seen: list[bool] = []
    _hold_plans(monkeypatch, str(tmp_path / "b"), reading, seen)
    run = oci.import_images([str(tmp_path / "a") + ":1", str(tmp_path / "b") + ":1"])
    assert seen == [True]  # a's layer was being read while b was still to be planned
    assert not run.failed and [r.ref for r in run.reports] == ["a@1", "b@1"]


def test_images_planned_after_a_layer_failed_or_its_first_image_failed(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Image a lists a good layer and a layer whose bytes do not match their digest; b,
    planned only after that layer has failed, lists the same good layer, and c the same bad
    one. The good layer is read to its end for b, though the only image that wanted it when
    a failed was a (no read is stopped while images are still being planned); c fails with
    the bad layer's digest named, as a did."""
    from dsec_cli.build import ociimport

    good = [file("good.bin", random.Random(5).randbytes(4 << 20))]
    bad = [file("bad.bin", os.urandom(4000))]
    wrote = write_layout(Image([good, bad]), tmp_path / "a", tag="1", tamper=1)
    write_layout(Image([good]), tmp_path / "b", tag="1")
    write_layout(Image([bad]), tmp_path / "c", tag="1", tamper=0)
    bad_blob = json.loads(wrote["layers"])[1]
    good_diff = json.loads(wrote["diff_ids"])[0]
    failed, good_read = threading.Event(), threading.Event()
    fail = ociimport.schedule._Run.fail

    def failing(self, diff_id, e):  # type: ignore[no-untyped-def]
        fail(self, diff_id, e)
        failed.set()

    stage = ociimport.schedule.stage_layer

    def staged(store, source, desc, diff_id, **kw):  # type: ignore[no-untyped-def]
        if diff_id != good_diff:
            return stage(store, source, desc, diff_id, **kw)
        failed.wait(10)  # the good layer is read once a has failed...
        try:
            return stage(store, source, desc, diff_id, **kw)
        finally:
            good_read.set()  # ...and b is planned once it has been read

    monkeypatch.setattr(ociimport.schedule._Run, "fail", failing)
    monkeypatch.setattr(ociimport.schedule, "stage_layer", staged)
    seen: list[bool] = []
    _hold_plans(monkeypatch, str(tmp_path / "b"), good_read, seen)
    _hold_plans(monkeypatch, str(tmp_path / "c"), failed, seen)
    run = oci.import_images([str(tmp_path / n) + ":1" for n in "abc"])
    assert seen == [True, True]
    assert [r.ref for r in run.reports] == ["b@1"]
    assert [s for s, _ in run.failed] == [str(tmp_path / n) + ":1" for n in "ac"]
    for _, e in run.failed:
        assert bad_blob in " ".join(e.message.split())
    images.export_image("b@1", tmp_path / "tree")
    assert (tmp_path / "tree/good.bin").read_bytes() == good[0].data
    assert verify(open_store(env["DSEC_STORE"]), deep=True).ok


def test_docker_save_tarballs_are_read_one_layer_at_a_time_each(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `docker save` tarballs of three layers each, in one run: the layers of one
    tarball share its file position and are read one after another, whatever the run reads
    beside them, and every file comes out whole."""
    import io
    import tarfile

    from .helpers import layer_tar, sha

    rng = random.Random(9)
    want: dict[str, dict[str, bytes]] = {}
    for name in ("s1", "s2"):
        layers = [[file(f"{name}/l{i}.bin", rng.randbytes(300_000 + i))] for i in range(3)]
        want[name] = {m.name: m.data for ms in layers for m in ms}
        plains = [layer_tar(ms) for ms in layers]
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                             "rootfs": {"type": "layers",
                                        "diff_ids": [sha(p) for p in plains]}}).encode()
        members = {**{f"l{i}/layer.tar": p for i, p in enumerate(plains)}, "cfg.json": config,
                   "manifest.json": json.dumps([{
                       "Config": "cfg.json", "RepoTags": [f"x/{name}:1"],
                       "Layers": [f"l{i}/layer.tar" for i in range(3)]}]).encode()}
        with tarfile.open(tmp_path / f"{name}.tar", "w") as tf:
            for member, data in members.items():
                ti = tarfile.TarInfo(member)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    from contextlib import contextmanager

    from dsec_cli.oci.sources import ArchiveSource

    lock = threading.Lock()
    active: dict[int, int] = {}
    most: dict[int, int] = {}
    blob = ArchiveSource.blob

    @contextmanager
    def counted(self, desc):  # type: ignore[no-untyped-def]
        with blob(self, desc) as f:  # layers read at once from this archive, at most
            with lock:
                active[id(self)] = active.get(id(self), 0) + 1
                most[id(self)] = max(most.get(id(self), 0), active[id(self)])
            try:
                yield f
            finally:
                with lock:
                    active[id(self)] -= 1

    monkeypatch.setattr(ArchiveSource, "blob", counted)
    run = oci.import_images([str(tmp_path / "s1.tar") + ":1", str(tmp_path / "s2.tar") + ":1"])
    assert not run.failed and [r.ref for r in run.reports] == ["s1@1", "s2@1"]
    assert sorted(most.values()) == [1, 1]  # two sources, each read one layer at a time
    for name, files in want.items():
        images.export_image(f"{name}@1", tmp_path / f"tree-{name}")
        for path, data in files.items():
            assert (tmp_path / f"tree-{name}" / path).read_bytes() == data


def test_layers_read_lean_make_the_same_layers_and_check_both_digests(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer read lean (fetched, hashed, inflated and parsed on one thread, as a layer
    read while the layers being read fill the cores is): the same layers, to their content
    digests (the packs a layer's chunks land in depend on which of two layers read side by
    side met them first), as read on four threads each; a tampered blob and a lying
    diff_id are refused all the same, with the digest named and the store as it was."""
    from dsec_cli.build import ociimport
    from dsec_cli.core.errors import IntegrityError

    imgs = {"a": Image([_base("1"), [file("app/a.txt", b"a")]], ["gzip", "none"]),
            "b": Image([_base("2"), [file("app/b.txt", b"b")]], ["zstd", "gzip"])}
    for name, img in imgs.items():
        write_layout(img, tmp_path / name, tag="1")
    sources = [str(tmp_path / n) + ":1" for n in imgs]
    made = {}
    for beside in (0, 99):  # every layer lean; none
        monkeypatch.setattr(ociimport.schedule, "LEAN_BESIDE", beside)
        store = (tmp_path / f"store-{beside}").as_uri()
        run = oci.import_images(sources, store=store)
        assert not run.failed
        made[beside] = [(r.ref, [(x.diff_id, x.content_digest, x.size) for x in r.layers])
                        for r in run.reports]
        assert verify(open_store(store), deep=True).ok
    assert made[0] == made[99]
    for n in imgs:
        images.export_image(f"{n}@1", tmp_path / f"tree-{n}", store=store)
        assert (tmp_path / f"tree-{n}/opt/big.bin").read_bytes() == BIG

    monkeypatch.setattr(ociimport.schedule, "LEAN_BESIDE", 0)
    before = store_files(env)
    digests = write_layout(base_image(), tmp_path / "tampered", tamper=1)
    with pytest.raises(IntegrityError, match=json.loads(digests["layers"])[1]):
        oci.import_image(str(tmp_path / "tampered"), as_ref="bad@1")
    write_layout(base_image(), tmp_path / "lying", lie=0)
    with pytest.raises(IntegrityError, match="not its diff_id sha256:0000"):
        oci.import_image(str(tmp_path / "lying"), as_ref="bad@2")
    assert store_files(env) == before


def test_images_ready_together_are_published_as_one_and_alone_if_that_fails(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two images on one base: their application layers end first, the base last, so both
    images are ready at once and their objects go to the store in one batch. The store
    refuses that batch (and only a batch holding both images): each image is then
    published on its own, and both come out whole."""
    from dsec_cli.build import ociimport

    base = _base("1")
    write_layout(Image([base, [file("app/a.txt", b"a")]]), tmp_path / "a", tag="1")
    write_layout(Image([base, [file("app/b.txt", b"b")]]), tmp_path / "b", tag="1")
    stage = ociimport.schedule.stage_layer

    def base_last(store, source, desc, diff_id, **kw):  # type: ignore[no-untyped-def]
        staged = stage(store, source, desc, diff_id, **kw)
        if desc.size > len(BIG) // 2:  # the base: ends well after both application layers
            threading.Event().wait(0.5)
        return staged

    monkeypatch.setattr(ociimport.schedule, "stage_layer", base_last)
    seen = _refuse_batches(monkeypatch, [tmp_path / "a", tmp_path / "b"], refuse=2)
    run = oci.import_images([str(tmp_path / n) + ":1" for n in "ab"])
    # together (refused), then one at a time
    assert seen == [(2, True), (1, False), (1, False)], seen
    assert not run.failed and [r.ref for r in run.reports] == ["a@1", "b@1"]
    ra, rb = run.reports
    assert rb.layers[0].manifest == ra.layers[0].manifest and rb.layers[0].reused
    assert verify(open_store(env["DSEC_STORE"]), deep=True).ok
    for n in "ab":
        images.export_image(f"{n}@1", tmp_path / f"tree-{n}")
        assert (tmp_path / f"tree-{n}/opt/big.bin").read_bytes() == BIG
        assert (tmp_path / f"tree-{n}/app/{n}.txt").read_bytes() == n.encode()


def test_an_image_whose_objects_fail_to_commit_leaves_its_layers_to_the_next(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store refuses every batch of objects that holds the first image's manifest (with
    its base layer's index, manifest and ref, whether the two images are published
    together or one by one): that image fails, and the second image, on the same base,
    publishes the base itself instead of naming objects that never appeared."""
    base = _base("1")
    write_layout(Image([base, [file("app/a.txt", b"a")]]), tmp_path / "a", tag="1")
    write_layout(Image([base, [file("app/b.txt", b"b")]]), tmp_path / "b", tag="1")
    seen = _refuse_batches(monkeypatch, [tmp_path / "a"], refuse=1)
    run = oci.import_images([str(tmp_path / "a") + ":1", str(tmp_path / "b") + ":1"])
    assert [s for s, _ in run.failed] == [str(tmp_path / "a") + ":1"]
    assert "refused in this test" in run.failed[0][1].message
    assert seen and all(refused for _, refused in seen)
    assert [r.ref for r in run.reports] == ["b@1"]
    assert [x.reused for x in run.reports[0].layers] == [False, False]
    assert verify(open_store(env["DSEC_STORE"]), deep=True).ok
    images.export_image("b@1", tmp_path / "tree")
    assert (tmp_path / "tree/opt/big.bin").read_bytes() == BIG


def test_several_registry_images_at_once(env: dict[str, str], registry: str, tmp_path: Path,
                                         run_dsec) -> None:  # type: ignore[no-untyped-def]
    """`dsec import A B` from a registry, as README shows it; and without the `oci` extra,
    each source reports the missing extra (never a module half imported by another
    thread)."""
    refs = []
    for n in "pq":
        write_layout(Image([[file(n, n.encode() * 64)]]), tmp_path / n, tag="1")
        skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / n}:1",
               f"docker://{registry}/many/{n}:1")
        refs.append(f"{registry}/many/{n}:1")
    hidden = ("import sys; sys.modules['oras'] = None; "
              "from dsec_cli.cli import main; main()")
    p = subprocess.run([sys.executable, "-c", hidden, "import", *refs], capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert p.returncode == 2, p
    assert p.stderr.count("needs the oci extra") == 2, p.stderr
    assert "cannot import name" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not any(k.startswith("refs/") for k in store_files(env))

    out = run_dsec("import", *refs, "--json")
    assert sorted(r["ref"] for r in json.loads(out.stdout)["images"]) == ["p@1", "q@1"]
