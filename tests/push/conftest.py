"""Fixtures of the push tests: one moto S3 server and one docker-registry per session, on
free loopback ports, and a fresh bucket, repository or directory per test (`make_url`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsec_cli.push import testing

from ..conformance.stores import store_url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    saved = {k: os.environ.get(k) for k in testing.S3_ENV}
    os.environ.update(testing.S3_ENV)  # boto3's standard chain finds them, as a user's would
    server = testing.start_moto()
    yield server.url
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def registry() -> Iterator[str]:
    server = testing.start_registry()
    yield server.url
    server.stop()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never read the developer's config, data directory or docker credentials."""
    monkeypatch.setenv("DSEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DSEC_CONFIG", str(tmp_path / "config.yaml"))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # oras reads ~/.docker/config.json
    monkeypatch.setenv("DSEC_STORE_RETRIES", "3")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("DSEC_STORE", raising=False)


@pytest.fixture
def make_url(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """make_url("s3") -> a URL of a new, empty store of that scheme, with its options in the
    URL itself (endpoint, plain HTTP) so that subprocesses can use it as it is (made as the
    store contract makes its stores: tests/conformance/stores.py)."""
    return lambda scheme: store_url(request, scheme)
