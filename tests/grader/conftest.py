"""The calc task the grader tests run: a task image (busybox, this machine's python3 and git,
a repository scrubbed to its base whose history held the fix) and its grader image (the same
layers plus the hidden tests), built once per session into a file store; a node per module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import build_store, node_env_of, use_node_env

from .gitrepos import repo_with_history, tar_dir
from .pyimage import python_tar

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TASK = "calc@1"
GRADER = "calc-grader@1"
BUGGY = "def add(a, b):\n    return a - b\n"
GOLD = "def add(a, b):\n    return a + b\n"
VISIBLE_TEST = ("import calc\n\n\ndef test_add_small():\n"
                "    assert calc.add(1, 1) == 2\n")

SPECS = {
    "python": """
layer: python
version: "3.11-host"
steps:
  - extract: {src: ./python.tar, dst: /, keep_mtime: true}
""",
    "calc-repo": """
layer: calc-repo
version: "1"
steps:
  - extract: {src: ./repo.tar, dst: /}
  - git_scrub: {path: /testbed}
workdir: /testbed
""",
    "calc-hidden": """
layer: calc-hidden
version: "1"
steps:
  - copy: {src: ./hidden, dst: /grader/tests, mode: "0700"}
  - copy: {src: ./pytest.ini, dst: /grader/pytest.ini, mode: "0600"}
""",
    "calc": """
image: calc
version: "1"
layers: [busybox@1.35-1, python@3.11-host, calc-repo@1]
workdir: /testbed
task:
  patch: ["*.py", "calc/**"]
  protected: ["tests/**"]
""",
    "calc-grader": """
image: calc-grader
version: "1"
layers: [busybox@1.35-1, python@3.11-host, calc-repo@1, calc-hidden@1]
workdir: /testbed
grade:
  command: >-
    mkdir -p -m 700 /grader/out && python3 -I -m pytest -q -c /grader/pytest.ini
    --rootdir=/grader --confcutdir=/grader --junitxml=/grader/out/junit.xml /grader/tests
  results: /grader/out/junit.xml
  tests: [test_add, test_add_negative, test_add_big]
  timeout: 120
  memory: 512M
  pids: 256
""",
}


@pytest.fixture(scope="session")
def grade_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grade-data")


@pytest.fixture(scope="session")
def grade_store(tmp_path_factory: pytest.TempPathFactory, grade_data: Path,
                busybox_tar: Path) -> str:
    """A file store holding the calc task and grader images."""
    specs = tmp_path_factory.mktemp("grade-specs")
    python_tar(specs / "python.tar")
    repo = specs / "work" / "testbed"
    repo_with_history(repo, {"calc.py": BUGGY, "tests/test_calc.py": VISIBLE_TEST})
    tar_dir(repo, specs / "repo.tar", "testbed")
    (specs / "hidden").mkdir()
    # stored under a name pytest does not collect here; the grader image calls it test_hidden
    shutil.copy(HERE / "task" / "hidden_tests.py", specs / "hidden" / "test_hidden.py")
    shutil.copy(HERE / "task" / "oracle_calc.py", specs / "hidden" / "oracle_calc.py")
    shutil.copy(HERE / "task" / "pytest.ini", specs / "pytest.ini")
    for name, text in SPECS.items():
        (specs / f"{name}.yaml").write_text(text)
    url = tmp_path_factory.mktemp("grade-store").as_uri()
    return build_store([REPO / "layerspecs/busybox/busybox.yaml",
                        *[specs / f"{n}.yaml" for n in SPECS]], url, grade_data)


@pytest.fixture(scope="module")
def grade_env(tmp_path_factory: pytest.TempPathFactory, grade_store: str,
              grade_data: Path) -> Iterator[dict[str, str]]:
    """DSEC_* variables for one node; every sandbox left is removed at the end."""
    yield from node_env_of(tmp_path_factory, grade_store, grade_data)


@pytest.fixture
def grade_home(grade_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's node and the task store as this test's dsec settings (modules that
    grade use it for every test)."""
    use_node_env(grade_env, monkeypatch)


@pytest.fixture(scope="module")
def node(grade_env: dict[str, str]) -> object:
    from dsec_cli.run.node import Node

    return Node(grade_env["DSEC_STATE_DIR"], grade_env["DSEC_STORE"])
