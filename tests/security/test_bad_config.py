"""Hostile configuration, specs and terminal output: a layer spec, a config file, a
``DSEC_MAX_*`` or ``limits.*`` value and ``DSEC_STORE`` are input like any argument, and what
a cluster node says in an error is shown, never obeyed by the terminal.

Each case runs the real `dsec` in a subprocess with its own home, config and store, and
checks exit 2 (bad input) with a message naming the file, variable or key and the value, no
Python traceback, and the store, config and data directories unchanged (no store made). The
node cases start one real sshd node (tests/cluster/sshnodes.py) whose `dsec` is a stand-in
that answers with the error under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.sshnodes import SshCluster, destroy_cluster, make_cluster
from tests.push.helpers import build_layer, make_tree

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "\x1b]0;pwned\x07\x1b[2J[bold]x[/bold]"


def _listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's bytes (None for a directory)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = (os.readlink(p).encode() if os.path.islink(p)
                                             else Path(p).read_bytes())
    return out


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding the layer a@1, built once for the module."""
    root = tmp_path_factory.mktemp("bad-config")
    make_tree(root / "specs" / "tree", seed=5, files=3)
    build_layer((root / "store").as_uri(), root / "specs", "a", "1")
    return root / "store"


class World:
    """This test's home (data, config, state), its copy-free view of the seeded store, and
    the real CLI run in a subprocess with an environment of bytes."""

    def __init__(self, tmp_path: Path, store: Path) -> None:
        self.tmp = tmp_path
        self.store = store
        self.config = tmp_path / "home" / "config" / "dsec" / "config.yaml"
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.work = tmp_path / "work"  # the working directory: specs and ./dsec.yaml
        self.work.mkdir()
        self.env: dict[bytes, bytes] = {
            **os.environb, b"DSEC_STORE": os.fsencode(store.as_uri()),
            b"DSEC_CONFIG": os.fsencode(self.config), b"COLUMNS": b"200"}

    def dsec(self, *args: str, env: dict[bytes, bytes] | None = None
             ) -> subprocess.CompletedProcess[str]:
        full = {**self.env, **(env or {})}
        p = subprocess.run([sys.executable, "-m", "dsec_cli", *args], capture_output=True,
                           cwd=self.work, env=full, timeout=120, stdin=subprocess.DEVNULL)
        return subprocess.CompletedProcess(p.args, p.returncode,
                                           p.stdout.decode(errors="backslashreplace"),
                                           p.stderr.decode(errors="backslashreplace"))

    def snapshot(self) -> tuple[object, object]:
        return _listing(self.store), _listing(self.tmp)

    def refused(self, p: subprocess.CompletedProcess[str], *mentions: str) -> None:
        """Exit 2 with a message that names each of ``mentions``, and no traceback."""
        assert p.returncode == 2, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        for m in mentions:
            assert m in p.stderr, f"{m!r} not in the message:\n{p.stderr[-3000:]}"
        assert len(p.stderr) < 5000, "the message repeats a huge input whole"


@pytest.fixture
def world(seeded: Path, tmp_path: Path) -> World:
    return World(tmp_path, seeded)


def _nested(depth: int, style: str) -> str:
    if style == "flow-seq":
        return "[" * depth + "]" * depth
    if style == "flow-map":
        return "{a: " * depth + "1" + "}" * depth
    return "".join(f"{' ' * i}a:\n" for i in range(depth)) + " " * depth + "b: 1\n"


#: a "billion laughs": nine levels, each ten aliases of the one below
LAUGHS = "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))

SPEC_HEAD = 'layer: bad\nversion: "1"\nsteps:\n  - copy: {src: ./tree, dst: /t}\n'

#: (file contents, what the message says)
BAD_YAML: dict[str, tuple[bytes, str]] = {
    "not-utf8": (SPEC_HEAD.encode() + b"description: caf\xe9\n", "not valid UTF-8"),
    "not-utf8-first-line": (b"\xff\xfe" + SPEC_HEAD.encode(), "not valid UTF-8"),
    "deep-flow-seq": (_nested(100_000, "flow-seq").encode(), "nested more than"),
    "deep-flow-map": (("a: " + _nested(100_000, "flow-map")).encode(), "nested more than"),
    "deep-block": (_nested(2000, "block").encode(), "nested more than"),
    "billion-laughs": ((SPEC_HEAD + LAUGHS).encode(), "expands to more than"),
    "recursive-alias": ((SPEC_HEAD + "x: &a [1, *a]\n").encode(), "contains it"),
}


@pytest.mark.parametrize("case", BAD_YAML)
def test_bad_spec_file(world: World, case: str) -> None:
    data, says = BAD_YAML[case]
    make_tree(world.work / "tree", seed=1, files=1)
    spec = world.work / "bad.yaml"
    spec.write_bytes(data)
    before = world.snapshot()
    p = world.dsec("build", "bad.yaml")
    world.refused(p, "bad.yaml", says)
    assert world.snapshot() == before, "a bad spec changed the store or the home"


def _in_a_node(text: str) -> bytes:
    """``text`` (mapping lines) as the entry of a node in a config file, where a config
    reader accepts keys it does not know."""
    lines = "".join(f"    {line}\n" for line in text.splitlines())
    return f"nodes:\n  n1:\n    address: root@127.0.0.1:1\n{lines}".encode()


BAD_CONFIG: dict[str, tuple[bytes, str]] = {
    **{k: (v.replace(SPEC_HEAD.encode(), b"nodes: {}\n"), says)
       for k, (v, says) in BAD_YAML.items() if k.startswith(("not-utf8", "deep"))},
    "billion-laughs": (_in_a_node(LAUGHS), "expands to more than"),
    "recursive-alias": (_in_a_node("x: &a {y: *a}"), "contains it"),
}


@pytest.mark.parametrize("where", ["user", "project"])
@pytest.mark.parametrize("case", BAD_CONFIG)
def test_bad_config_file(world: World, case: str, where: str) -> None:
    data, says = BAD_CONFIG[case]
    path = world.config if where == "user" else world.work / "dsec.yaml"
    path.write_bytes(data)
    before = world.snapshot()
    world.refused(world.dsec("ls"), str(path), says)
    assert world.snapshot() == before, "a bad config file changed the store or the home"


def test_bad_config_file_stops_commands_that_write_it(world: World) -> None:
    world.config.write_bytes(BAD_YAML["deep-flow-seq"][0])
    before = world.snapshot()
    for args in (["node", "add", "n1", "root@h", "--no-check"], ["inspect", "a@1"]):
        world.refused(world.dsec(*args), str(world.config), "nested more than")
    assert world.snapshot() == before


#: (variable, value): every kind of bad value, each limit in turn
BAD_LIMITS = [("REF_BYTES", "0"), ("MANIFEST_BYTES", "-1"), ("INDEX_ENTRIES", "abc"),
              ("REF_BYTES", "1.5"), ("MANIFEST_BYTES", "0.4"), ("INDEX_BYTES", "nan"),
              ("REF_BYTES", "inf"), ("MANIFEST_BYTES", "1e400"),
              ("PACK_TRAILER_BYTES", "99999999999999999999999"), ("CHUNK_BYTES", "2E")]


@pytest.mark.parametrize("name,value", BAD_LIMITS)
def test_bad_limit_variable(world: World, name: str, value: str) -> None:
    var = f"DSEC_MAX_{name}"
    before = world.snapshot()
    p = world.dsec("ls", env={var.encode(): value.encode()})
    world.refused(p, var, repr(value))
    assert world.snapshot() == before


def test_bad_limit_stops_inspect_before_reading(world: World) -> None:
    p = world.dsec("inspect", "a@1", env={b"DSEC_MAX_MANIFEST_BYTES": b"0"})
    world.refused(p, "DSEC_MAX_MANIFEST_BYTES", "'0'")
    assert "a@1" not in p.stdout


@pytest.mark.parametrize("value", ["0", "-5", "ten", "1.5", "[1]", "true", "1e400"])
def test_bad_limit_in_config(world: World, value: str) -> None:
    world.config.write_text(f"limits: {{ref_bytes: {value}}}\n")
    before = world.snapshot()
    p = world.dsec("ls")
    world.refused(p, str(world.config), "limits.ref_bytes")
    assert world.snapshot() == before


def test_good_limits_still_work(world: World) -> None:
    world.config.write_text("limits: {ref_bytes: 64K, manifest_bytes: 4194304}\n")
    p = world.dsec("ls", env={b"DSEC_MAX_INDEX_ENTRIES": b"1M"})
    assert p.returncode == 0 and "a@1" in p.stdout and "broken" not in p.stderr, p.stderr


@pytest.mark.parametrize("url", [b"@T@/st\xffore", b"file://@T@/st\xffore",
                                 b"file://@T@/st%FFore", b"ftp://@T@/x", b"file://@T@/a\x1bb"],
                         ids=["path", "file-url", "percent", "scheme", "control"])
def test_bad_store_variable(world: World, url: bytes) -> None:
    url = url.replace(b"@T@", os.fsencode(world.tmp))
    before = world.snapshot()
    for args in (["ls"], ["rmi", "a@1"]):
        p = world.dsec(*args, env={b"DSEC_STORE": url})
        world.refused(p, "store URL" if b"%" in url else "DSEC_STORE")
    assert world.snapshot() == before, "a bad DSEC_STORE created or changed something"


def test_bad_store_in_config_names_the_file(world: World) -> None:
    world.config.write_text("store: ftp://elsewhere/x\n")
    env = {k: v for k, v in world.env.items() if k != b"DSEC_STORE"}
    p = subprocess.run([sys.executable, "-m", "dsec_cli", "ls"], capture_output=True, text=True,
                       cwd=world.work, env=env, timeout=120)
    world.refused(p, str(world.config), "ftp://elsewhere/x")


def test_reading_commands_create_no_store(world: World) -> None:
    """`ls`, `inspect`, `verify` of a store that does not exist are an error naming it and
    create nothing: neither the named store nor the default one under the data directory
    (which reads as empty)."""
    missing = world.tmp / "no-store"
    before = world.snapshot()
    for env in ({b"DSEC_STORE": os.fsencode(missing)},
                {b"DSEC_STORE": os.fsencode(missing.as_uri())}):
        for argv in (["ls"], ["inspect", "a@1"], ["verify"]):
            p = world.dsec(*argv, env=env)
            assert p.returncode == 2 and "no store at" in p.stderr, p
            assert "Traceback" not in p.stderr
    default = {k: v for k, v in world.env.items() if k != b"DSEC_STORE"}
    default[b"XDG_DATA_HOME"] = os.fsencode(world.tmp / "data")
    p = subprocess.run([sys.executable, "-m", "dsec_cli", "ls"], capture_output=True,
                       cwd=world.work, env=default, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not missing.exists() and not (world.tmp / "data").exists()
    assert world.snapshot() == before


# -- what a node says ---------------------------------------------------------------------
#: a node service stand-in: answers hello as a node of this protocol, and every other
#: request with the error it was given
LIAR = """#!{python}
import json, sys
error = json.loads({error!r})
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "hello":
        reply = {{"id": msg["id"], "ok": True, "result": {{"protocol": {version}}}}}
    else:
        reply = {{"id": msg["id"], "ok": False, "error": error}}
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshCluster]:
    if os.geteuid() != 0:
        pytest.skip("an sshd node needs root")
    root = tmp_path_factory.mktemp("liar-node")
    (root / "data").mkdir()
    c = make_cluster(root / "nodes", (root / "store").as_uri(), root / "data", 1)
    try:
        yield c
    finally:
        destroy_cluster(c)


def _liar(world: World, cluster: SshCluster, error: object) -> dict[bytes, bytes]:
    """The node `liar` (the real sshd node, the stand-in as its dsec) in this test's config;
    returns the environment to reach it."""
    from dsec_cli.run.cluster.protocol import PROTOCOL_VERSION

    script = world.tmp / "liar"
    script.write_text(LIAR.format(python=sys.executable, error=json.dumps(error),
                                  version=PROTOCOL_VERSION))
    script.chmod(0o755)
    world.tmp.chmod(0o755)
    nodes = cluster.config_nodes()
    node = {**next(iter(nodes.values())), "dsec": str(script)}
    world.config.write_text(json.dumps({"nodes": {"liar": node}}))  # JSON is YAML
    env = {k.encode(): v.encode() for k, v in cluster.client_env().items()}
    return {**env, b"DSEC_NODE_AGENT": b"stdio"}


def test_node_error_text_reaches_the_terminal_escaped(world: World, one_node: SshCluster) -> None:
    env = _liar(world, one_node, {"type": "SandboxError", "message": f"boom {HOSTILE}",
                                  "hint": f"hint {HOSTILE}", "exit_code": 1})
    for args in (["ps", "--node", "liar"], ["rm", "liar/abc"], ["exec", "liar/abc", "--", "id"],
                 ["ps", "--all-nodes"]):
        p = world.dsec(*args, env=env)
        assert p.returncode == 1, f"{args}: exit {p.returncode}\n{p.stderr}"
        assert "Traceback" not in p.stderr, p.stderr
        assert "\x1b" not in p.stderr and "\x07" not in p.stderr, repr(p.stderr)
        assert "liar: boom \\x1b]0;pwned\\x07\\x1b[2J[bold]x[/bold]" in p.stderr, p.stderr
        if args[-1] != "--all-nodes":  # a fan-out reports each node's message, not its hint
            assert "hint \\x1b]0;pwned" in p.stderr, p.stderr


def test_node_error_text_in_a_table_is_escaped(world: World, one_node: SshCluster) -> None:
    env = _liar(world, one_node, {"type": "SandboxError", "message": f"boom {HOSTILE}",
                                  "exit_code": 1})
    p = world.dsec("node", "ls", env=env)
    out = p.stdout + p.stderr
    assert "Traceback" not in out and "\x1b" not in out and "\x07" not in out, repr(out)
    assert "liar" in p.stdout and "\\x1b]0;pwned" in out, out


@pytest.mark.parametrize("error", [
    {"type": "RefConflictError", "message": "claims success", "exit_code": 0},
    {"type": "Nope", "message": "claims success", "exit_code": 0},
    {"type": "SandboxError", "message": ["not", "text"], "hint": {"a": 1}, "exit_code": "x"},
    "an error that is not an object",
], ids=["exit-0-other-constructor", "exit-0-unknown-type", "wrong-types", "not-an-object"])
def test_node_error_of_the_wrong_shape(world: World, one_node: SshCluster, error: object) -> None:
    """A node's error is an error here whatever it claims: exit 1 (never 0), no traceback."""
    p = world.dsec("ps", "--node", "liar", env=_liar(world, one_node, error))
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr}"
    assert "Traceback" not in p.stderr and "liar" in p.stderr, p.stderr


@pytest.mark.parametrize("text,shown", [
    (HOSTILE, "\\x1b]0;pwned\\x07\\x1b[2J[bold]x[/bold]"),
    ("cr\rover", "cr\\rover"),
    ("csi \x9b2J and \u202eevil", "csi \\x9b2J and \\u202eevil"),
    ("bytes \udcff here", "bytes \\udcff here"),
    ("kept: newline\nand [/] :smile: \\", "kept: newline\nand [/] :smile: \\\n"),
])
def test_error_printer_shows_text_as_text(text: str, shown: str,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    from dsec_cli.cli.render import print_error
    from dsec_cli.core.errors import DsecError

    print_error(DsecError(text, hint=text))
    err = capfd.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\x9b" not in err, repr(err)
    assert err.count(shown) == 2, repr(err)
