"""Fixtures of the OCI tests: a docker-registry on loopback per session, an isolated store,
data dir and docker config per test, and the environment for subprocesses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_cli.push import testing


@pytest.fixture(scope="session")
def registry() -> Iterator[str]:
    server = testing.start_registry()
    yield server.url
    server.stop()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh embedded store and data dir, and no docker credentials of the developer's;
    set for this process and returned for subprocesses."""
    values = {"DSEC_STORE": (tmp_path / "store").as_uri(),
              "DSEC_DATA_DIR": str(tmp_path / "data"),
              "DSEC_CONFIG": str(tmp_path / "config.yaml"),
              "DOCKER_CONFIG": str(tmp_path / "docker"),
              "DSEC_STORE_RETRIES": "3"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


def store_files(env: dict[str, str]) -> dict[str, int]:
    """Every object of the test's file store (path -> size), temporary files excepted."""
    root = Path(env["DSEC_STORE"].removeprefix("file://"))
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if not rel.startswith(("tmp/", "leases/")):
                out[rel] = p.stat().st_size
    return out


USERS = {"alice": "s3cret-pass"}


@pytest.fixture
def node(env: dict[str, str], dsec_home: Path) -> Iterator[dict[str, str]]:
    """The test's environment; afterwards its node holds no sandbox and no cached layer."""
    yield env
    from dsec_cli.run.node import Node

    n = Node(dsec_home / "state", env["DSEC_STORE"])
    for r in n.db.all():
        n.remove(r.id)
    n.gc(budget=0)


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[str]:
    """A registry that answers only requests with alice's credentials."""
    server = testing.start_registry(users=USERS)
    yield server.url
    server.stop()
