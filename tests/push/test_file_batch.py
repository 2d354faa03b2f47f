"""The file store's write batch (`FileStore.write_batch`) keeps the store's write order:
every object of a batch is fsynced before the first is renamed into place, the renames
follow the order of the puts, other threads see nothing before the end, and a block that
fails shows nothing and leaves no temporary file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dsec_cli.push.stores import file as filestore
from dsec_cli.push.stores import open_store


def test_all_synced_before_any_shown_then_shown_in_order(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    st = open_store((tmp_path / "s").as_uri())
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        with lock:
            events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: object, dst: object) -> None:
        real_replace(src, dst)  # type: ignore[arg-type]
        with lock:  # once it is done (a first try may find the directory missing)
            events.append(("show", str(dst)))

    monkeypatch.setattr(filestore.os, "fsync", fsync)
    monkeypatch.setattr(filestore.os, "replace", replace)
    keys = ["indexes/aa/one", "manifests/bb/two", "refs/img/1", "manifests/cc/three"]
    with st.write_batch():
        for n, k in enumerate(keys):
            st.put(k, b"x" * (n + 1))
        assert not events[1:] or all(e[0] == "sync" for e in events)
        seen = []
        t = threading.Thread(target=lambda: seen.extend(st.has(k) for k in keys))
        t.start()
        t.join()
        assert seen == [False] * 4  # not visible to another thread yet
    syncs = [i for i, e in enumerate(events) if e[0] == "sync"]
    shows = [e[1] for e in events if e[0] == "show"]
    assert len(syncs) == 4 and max(syncs) < min(i for i, e in enumerate(events)
                                                if e[0] == "show")
    assert shows == [str(tmp_path / "s" / k) for k in keys]
    assert [st.get(k) for k in keys] == [b"x" * (n + 1) for n in range(4)]


def test_a_failed_block_shows_nothing_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    st = open_store((tmp_path / "s").as_uri())
    with pytest.raises(RuntimeError), st.write_batch():
        st.put("indexes/aa/one", b"1")
        st.put("refs/img/1", b"2")
        raise RuntimeError("stop")
    assert not st.has("indexes/aa/one") and not st.has("refs/img/1")
    assert not [p for p in (tmp_path / "s" / "tmp").iterdir() if p.name.endswith(".tmp")]
    st.put("refs/img/1", b"3")  # and the store writes as before afterwards
    assert st.get("refs/img/1") == b"3"
