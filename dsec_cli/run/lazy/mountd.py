"""The lazy mount daemon: ``python -m dsec_cli.run.lazy.mountd CONFIG.json``.

One process per lazy mount, started in its own session so it outlives the `dsec` command that
made the sandbox (detached sandboxes keep reading their layers). It loads the layers' indexes,
mounts `LazyFS`, says "ready" on the file descriptor it was given, prefetches the layers'
prefetch lists, optionally fetches everything in the background, and writes its statistics
and access profile beside its config while it runs and when it exits (on unmount or SIGTERM).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...core.errors import CorruptObjectError

log = logging.getLogger("dsec_cli.run.lazy.mountd")

#: chunks queued for the chunk cache's writer thread at most (cache.py), and how long an
#: ending daemon waits for them to be written (a chunk not written is fetched again later)
WRITE_BEHIND = 64 << 20
DRAIN_SECONDS = 3.0
#: a running daemon rewrites its access profile at most this often (seconds)
PROFILE_EVERY = 1.0

#: FUSE options: read-only, shared with the sandbox's (root) overlay and anyone it lets in;
#: page cache kept across opens and attributes cached for a long time (the tree never changes)
MOUNT_OPTIONS = {"ro": True, "allow_other": True, "default_permissions": True,
                 "kernel_cache": True, "attr_timeout": 86400, "entry_timeout": 86400,
                 "negative_timeout": 86400}


def _write_json(path: Path, doc: Any) -> None:
    # a temporary name of the writing thread's own: the flush thread and the main thread
    # (before the mount and after it) both write these documents
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    state = Path(config_path).parent
    logging.basicConfig(filename=str(state / "mountd.log"), level=cfg.get("log", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ...push.dedup import load_index
    from ...push.materialize import store_fetch
    from ...push.stores import open_store
    from .cache import ChunkCache
    from .fs import LazyFS, LazyFSNoXattrs, Recorder, needs_xattrs
    from .source import Fetcher, LayerSource

    store = open_store(cfg["store"])
    indexes = [load_index(store, layer["index"]) for layer in cfg["layers"]]
    for layer, ix in zip(cfg["layers"], indexes, strict=True):
        if ix.content_digest() != layer["content_digest"]:  # the node checked; so do we
            raise CorruptObjectError(f"index {layer['index'][:12]} does not have content "
                                     f"digest {layer['content_digest'][:12]}")
    cache = ChunkCache(Path(cfg["cache"]), int(cfg["budget"]), write_behind=WRITE_BEHIND)
    cache.sweep()
    fetcher = Fetcher(store_fetch(store), cache, max_read=int(cfg.get("max_read") or
                                                                store.preferred_read_size),
                      inflight=int(cfg.get("inflight", 4)))
    sources = [LayerSource(ix, fetcher) for ix in indexes]
    recorder = Recorder(len(indexes), float(cfg.get("record_seconds", 30)))
    stop = threading.Event()
    ready_fd = cfg.get("ready_fd")

    profiled = {"files": -1, "at": 0.0}
    #: more documents written beside stats.json, by name (the compiled FUSE loop's counters)
    extras: dict[str, Any] = {}

    def flush(final: bool = True) -> None:
        """Statistics each time; the profile (sorting and writing every file read so far)
        when it grew and at most once a second while running, and at the end."""
        _write_json(state / "stats.json", {**fetcher.stats.public(), "mode": cfg["mode"],
                                           "pid": os.getpid()})
        for name, doc in list(extras.items()):
            _write_json(state / f"{name}.json", doc())
        files, now = sum(len(f) for f in recorder.collect()), time.monotonic()
        if not final and (files == profiled["files"] or now - profiled["at"] < PROFILE_EVERY):
            return
        profiled.update(files=files, at=now)
        profile = [{"content_digest": layer["content_digest"], "files": sorted(
            recorder.files[n].items(), key=lambda kv: kv[1])}
            for n, layer in enumerate(cfg["layers"])]
        _write_json(state / "profile.json", {"layers": profile})

    def warm() -> None:
        try:
            for n, (ix, src) in enumerate(zip(indexes, sources, strict=True)):
                if ix.prefetch:
                    by_path = {e.path: e for e in ix.entries}
                    entries = [by_path[p] for p in ix.prefetch if p in by_path]
                    src.warm(src.chunk_numbers(entries), stop=stop)
                    fetcher.stats.add(prefetched_files=len(entries))
                    log.info("layer %d: prefetched %d files", n, len(entries))
            if cfg["mode"] == "background":
                for src in sources:
                    src.warm(list(range(len(src.index.chunks))), stop=stop,
                             workers=max(1, int(cfg.get("inflight", 4)) - 1))
                fetcher.stats.background_done = not stop.is_set()
                log.info("background fetch finished")
        except Exception as e:  # readers still fetch on demand; say why warming stopped
            log.error("prefetch stopped: %s", e)

    def on_init() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"R")
            os.close(ready_fd)
        threading.Thread(target=warm, name="warm", daemon=True).start()

    def flusher() -> None:
        last: dict[str, Any] = {}
        while not stop.wait(0.1):
            now = {"stats": fetcher.stats.public(), **{k: d() for k, d in list(extras.items())}}
            if now != last or sum(len(f) for f in recorder.collect()) != profiled["files"]:
                flush(final=False)
                last = now

    # no Python SIGTERM handler: the main thread sits in libfuse's loop and would never run
    # it; libfuse's own handler ends the loop, unmounts, and the finally below flushes
    threading.Thread(target=flusher, name="flush", daemon=True).start()
    xattrs = needs_xattrs(indexes)
    kind = LazyFS if xattrs else LazyFSNoXattrs
    if cfg.get("server") == "kernel":
        return _serve_kernel(LazyFS(indexes, sources, recorder), cfg, state, xattrs, on_init,
                             stop, flush, cache, extras)
    # mfusepy takes libfuse 2 when both are installed; the options below are libfuse 3's
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    import mfusepy

    fs = kind(indexes, sources, recorder, on_init)
    flush()
    try:
        mfusepy.FUSE(fs, cfg["mountpoint"], foreground=True, fsname="dsec-lazy",
                     subtype="dsec", **MOUNT_OPTIONS)
    finally:
        stop.set()
        cache.drain(DRAIN_SECONDS)
        flush()
        log.info("unmounted after %.1fs", time.monotonic() - recorder.started)
    return 0


def _serve_kernel(fs: Any, cfg: dict[str, Any], state: Path, xattrs: bool, on_init: Any,
                  stop: threading.Event, flush: Any, cache: Any, extras: dict[str, Any]) -> int:
    """Serve the mount with FUSE passthrough (kernelfs.py): opened files are read by the
    kernel from backing files in the node's file cache, beside its chunk cache."""
    from .kernelfs import PassthroughServer

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)  # the main thread sits in read(/dev/fuse): this ends it

    signal.signal(signal.SIGTERM, on_term)
    from .cache import ChunkCache

    files = ChunkCache(Path(cfg["cache"]).parent / "files", int(cfg["budget"]))
    server = PassthroughServer(fs, cfg["mountpoint"], files, xattrs=xattrs,
                               on_init=on_init, workers=max(2, int(cfg.get("inflight", 4))))
    server.sweep()
    flush()
    try:
        server.mount()
        # requests the compiled loop answered and handed on (loop.json; {} without it)
        extras["loop"] = server.counters
        server.serve()
    finally:
        stop.set()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(cfg["mountpoint"].encode(), 2)  # MNT_DETACH; gone already is fine
        server.close()
        cache.drain(DRAIN_SECONDS)
        flush()
        log.info("unmounted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
