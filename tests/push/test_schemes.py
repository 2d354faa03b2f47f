"""A store scheme added with `register_scheme` is a store like the built-in ones: store URLs
of it pass validation, the SDK and the CLI open it, and it keeps the store contract."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsec_cli.core import schemes, validate
from dsec_cli.core.errors import UsageError
from dsec_cli.push.stores import open_store, register_scheme
from dsec_cli.push.stores.file import FileStore

from ..conformance.stores import CONTRACT
from .helpers import raw_layer

REPO = Path(__file__).resolve().parents[2]
REGISTER = ("from dsec_cli.push.stores import register_scheme; "
            f"register_scheme('dirs', {__name__!r}, 'DirStore')")


class DirStore(FileStore):
    """A file store under a scheme of its own (``dirs:///path``): all a new scheme needs
    is a `Store` subclass and its registration."""

    scheme = "dirs"

    @classmethod
    def from_url(cls, url: str, **options: object) -> DirStore:
        inner = FileStore.from_url("file" + url[len("dirs"):], **options)
        return cls(url, inner.root)


@pytest.fixture
def dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The scheme registered for this test only; the URL of a new store of it."""
    monkeypatch.setattr(schemes, "SCHEMES", dict(schemes.SCHEMES))
    register_scheme("dirs", __name__, "DirStore")
    return f"dirs://{tmp_path / 'store'}"


def test_validation_asks_the_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(schemes, "SCHEMES", dict(schemes.SCHEMES))
    url = f"dirs://{tmp_path}"
    with pytest.raises(UsageError, match="unknown store URL scheme 'dirs'"):
        validate.store_url(url)
    register_scheme("dirs", __name__, "DirStore")
    assert validate.store_url(url) == url
    with pytest.raises(UsageError, match="dirs://, file://, oci://, s3://"):
        validate.store_url("nope://x")


@pytest.mark.parametrize("bad", ["", "Dirs", "1x", "a b", "x:"])
def test_a_scheme_is_checked_when_registered(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schemes, "SCHEMES", dict(schemes.SCHEMES))
    with pytest.raises(UsageError, match="invalid store URL scheme"):
        register_scheme(bad, __name__, "DirStore")


def test_the_sdk_and_the_cli_use_the_store(dirs: str) -> None:
    from dsec_cli.api import images

    with open_store(dirs) as st:
        digest = raw_layer(st, "lib", "1", [b"pack bytes"])
    assert (Path(dirs[len("dirs://"):]) / "refs").is_dir()  # written where the URL says
    listed = images.list_images(store=dirs)
    assert [(i.ref, i.digest) for i in listed] == [("lib@1", digest)]
    cmd = [sys.executable, "-c", f"{REGISTER}; from dsec_cli.cli import main; main()",
           "ls", "--store", dirs, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    assert [d["ref"] for d in json.loads(p.stdout)] == ["lib@1"]
    p = subprocess.run(cmd[:1] + ["-c", "from dsec_cli.cli import main; main()"] + cmd[3:],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 2 and "unknown store URL scheme 'dirs'" in " ".join(p.stderr.split())


@pytest.mark.parametrize("check", CONTRACT, ids=lambda f: f.__name__)
def test_the_registered_scheme_keeps_the_store_contract(
        check: Callable[..., Any], dirs: str, tmp_path: Path) -> None:
    store = open_store(dirs)
    try:
        extra = {"tmp_path": tmp_path} if "tmp_path" in inspect.signature(check).parameters \
            else {}
        check(store, **extra)
    finally:
        store.close()
