"""Hostile values for every command and option: each exits 2 with a message that names the
option or the value, never shows a Python traceback, and changes neither the store nor the
user's config.

The sweep runs the real `dsec` entry point (`dsec_cli.cli.main`) in this process, which is
what the console script runs, so that ninety cases stay fast; a few cases that depend on how
the operating system hands arguments over (bytes that are not UTF-8, a 100 000-character
argument) run it as a subprocess."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from dsec_cli.core import validate
from dsec_cli.core.errors import UsageError
from tests.push.helpers import build_layer, make_tree

REPO = Path(__file__).resolve().parents[2]
LONG = "a" * 100_000
RUN = ["run", "a@1"]
END = ["--", "true"]

#: (argv, what the message must mention)
CASES: list[tuple[list[str], str]] = [
    # references
    (["inspect", ""], "sandbox id"),
    (["inspect", "a\nb@1"], "reference"),
    (["inspect", "a@1\n"], "reference"),
    (["export", "", "out"], "reference"),
    (["run", "x@", *END], "reference"),
    (["run", "@1", *END], "reference"),
    (["run", "", *END], "IMAGE"),
    (["push", "", "--to", "file://@DEST@/x"], "reference"),
    (["push", "x@", "--to", "file://@DEST@/x"], "reference"),
    (["push", "a@" + "1" * 300, "--to", "file://@DEST@/x"], "reference"),
    (["pull", "a@", "--from", "file://@DEST@/x"], "reference"),
    (["rmi", ""], "reference"),
    (["rmi", "x@"], "reference"),
    (["rmi", LONG], "reference"),
    (["snapshot", "abc", "--as", "bad"], "snapshot name"),
    (["optimize", ""], "reference"),
    # sandbox ids
    (["exec", "", *END], "sandbox id"),
    (["exec", LONG, *END], "sandbox id"),
    (["exec", "a\nb", *END], "sandbox id"),
    (["exec", "no/such", *END], "no"),
    (["exec", "a/b/c", *END], "sandbox id"),
    (["exec", "x", "--timeout", "nan", *END], "--timeout"),
    (["exec", "x", "--timeout", "-1", *END], "--timeout"),
    (["rm", ""], "sandbox id"),
    (["rm", "no/such"], "no"),
    (["pause", ""], "sandbox id"),
    (["resume", LONG], "sandbox id"),
    (["snapshot", "", "--as", "a@2"], "sandbox id"),
    (["cp", "bad:id:/x", "."], "bad"),
    (["cp", "", ""], "cp"),
    (["cp", "a:b", "c:d"], "cp"),
    # store URLs and endpoints
    (["push", "a@1", "--to", "ftp://x"], "ftp"),
    (["push", "a@1", "--to", "s3://"], "s3://"),
    (["push", "a@1", "--to", "oci://"], "oci://"),
    (["push", "a@1", "--to", ""], "store URL"),
    (["push", "a@1", "--to", "s3://b\nx"], "store URL"),
    (["push", "a@1", "--to", "s3://Bad_Bucket"], "Bad_Bucket"),
    (["push", "a@1", "--to", "oci://h:99999/x"], "oci://h:99999/x"),
    (["push", "a@1", "--to", "oci://h:0/x"], "oci://h:0/x"),
    (["push", "a@1", "--to", "file://"], "file://"),
    (["push", "a@1", "--to", "s3://bkt", "--endpoint-url", "ftp://x"], "--endpoint-url"),
    (["push", "a@1", "--to", "s3://bkt", "--endpoint-url", "http://h:99999"],
     "--endpoint-url"),
    (["push", "a@1", "--to", "file://@DEST@/x", "-j", "0"], "--jobs"),
    (["pull", "a@1", "--from", "ftp://x"], "ftp"),
    (["pull", "a@1", "--from", ""], "store URL"),
    (["ls", "--store", ""], "store URL"),
    (["ls", "--store", "ftp://x"], "ftp"),
    (["ls", "nonsense"], "nonsense"),
    (["rmi", "a@1", "--store", "gopher://x"], "gopher"),
    (["gc", "--store", ""], "store URL"),
    (["gc", "--store", "s3://"], "s3://"),
    (["build", "--store", "ftp://x"], "ftp"),
    (["run", *RUN[1:], "--fetch", "sometimes", *END], "--fetch"),
    # sizes, durations, numbers
    ([*RUN, "--memory", "-5", *END], "--memory"),
    ([*RUN, "--memory", "1ZB", *END], "--memory"),
    ([*RUN, "--memory", "nan", *END], "--memory"),
    ([*RUN, "--memory", "inf", *END], "--memory"),
    ([*RUN, "--memory", "1e30", *END], "--memory"),
    ([*RUN, "--memory", "", *END], "--memory"),
    ([*RUN, "--cpus", "nan", *END], "--cpus"),
    ([*RUN, "--cpus", "inf", *END], "--cpus"),
    ([*RUN, "--cpus", "-1", *END], "--cpus"),
    ([*RUN, "--cpus", "0", *END], "--cpus"),
    ([*RUN, "--pids", "0", *END], "--pids"),
    ([*RUN, "--pids", "-3", *END], "--pids"),
    ([*RUN, "--pids", "x", *END], "--pids"),
    ([*RUN, "--ttl", "5x", *END], "--ttl"),
    ([*RUN, "--ttl", "nan", *END], "--ttl"),
    ([*RUN, "--ttl", "-1h", *END], "--ttl"),
    ([*RUN, "--ttl", "1e400", *END], "--ttl"),
    ([*RUN, "--timeout", "nan", *END], "--timeout"),
    ([*RUN, "--timeout", "-1", *END], "--timeout"),
    ([*RUN, "--node", "", *END], "--node"),
    ([*RUN, "--node", "a\nb", *END], "--node"),
    ([*RUN, "--backend", "", *END], "backend"),
    ([*RUN, "--network", "all", *END], "--network"),
    ([*RUN, "-e", "=x", *END], "--env"),
    ([*RUN, "-w", "rel", *END], "workdir"),
    # huge counts and waits (an image that does not exist: nothing runs if one passes)
    (["run", "nosuch@1", "--pids", "99999999999999999999999", *END], "--pids"),
    (["run", "nosuch@1", "--pids", "4194305", *END], "--pids"),
    (["run", "nosuch@1", "--pids", "1e23", *END], "--pids"),
    (["run", "nosuch@1", "--cpus", "1e23", *END], "--cpus"),
    (["run", "nosuch@1", "--timeout", "1e300", *END], "--timeout"),
    (["run", "nosuch@1", "--disk", "1e30", *END], "--disk"),
    (["run", "nosuch@1", "--disk", "-1", *END], "--disk"),
    (["run", "nosuch@1", "--disk", "inf", *END], "--disk"),
    (["run", "nosuch@1", "--ttl", "inf", *END], "--ttl"),
    (["run", "-d", "nosuch@1", "--pids", "99999999999999999999999"], "--pids"),
    (["exec", "x", "--timeout", "1e300", *END], "--timeout"),
    (["node", "ls", "--timeout", "1e300"], "--timeout"),
    (["top", "--interval", "1e300"], "--interval"),
    (["fork", "x", "-n", "99999999999999999999"], "count"),
    (["job", "start", "j", "--snapshot-every", "99999999999999999999"], "snapshot"),
    (["job", "start", "j", "--max-concurrent", "-1"], "max-concurrent"),
    (["gc", "--grace", "-1h"], "--grace"),
    (["gc", "--grace", "5x"], "--grace"),
    (["gc", "--grace", "nan"], "--grace"),
    (["gc", "--grace", ""], "--grace"),
    (["gc", "--repack-threshold", "nan"], "--repack-threshold"),
    (["gc", "--repack-threshold", "2"], "--repack-threshold"),
    (["gc", "--node", "--budget", "1ZB"], "--budget"),
    (["gc", "--node", "--budget", "-1"], "--budget"),
    (["gc", "--node", "--budget", "inf"], "--budget"),
    # nodes
    (["node", "add", "", "root@h", "--no-check"], "node name"),
    (["node", "add", "a\nb", "root@h", "--no-check"], "node name"),
    (["node", "add", "a\x01", "root@h", "--no-check"], "node name"),
    (["node", "add", LONG, "root@h", "--no-check"], "node name"),
    (["node", "add", "auto", "root@h", "--no-check"], "node name"),
    (["node", "add", "n1", "root@h:99999", "--no-check"], "root@h:99999"),
    (["node", "add", "n1", "root@h:0", "--no-check"], "root@h:0"),
    (["node", "add", "n1", "root@h\n", "--no-check"], "node address"),
    (["node", "add", "n1", "root@\nh", "--no-check"], "node address"),
    (["node", "add", "n1", "", "--no-check"], "node address"),
    (["node", "add", "n1", "root@h", "--labels", "x", "--no-check"], "label"),
    (["node", "add", "n1", "root@h", "--identity", "", "--no-check"], "identity"),
    (["node", "rm", ""], "node"),
    (["node", "check", ""], "node"),
    (["node", "check", "a\nb"], "node"),
    (["node", "ls", "--timeout", "nan"], "--timeout"),
    (["node", "ls", "--timeout", "-1"], "--timeout"),
    (["agent"], "--stdio"),
]


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            p = Path(dirpath, name)
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(p.read_bytes() if not p.is_symlink() else os.readlink(p).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding a@1, built once for the module."""
    root = tmp_path_factory.mktemp("bad-input")
    specs = root / "specs"
    make_tree(specs / "tree", seed=3, files=3)
    build_layer((root / "store").as_uri(), specs, "a", "1")
    return root / "store"


@pytest.fixture
def store(seeded: Path, monkeypatch: pytest.MonkeyPatch, dsec_home: Path,
          tmp_path: Path) -> Path:
    monkeypatch.setenv("DSEC_STORE", seeded.as_uri())
    monkeypatch.setenv("DSEC_CONFIG", str(tmp_path / "config.yaml"))
    monkeypatch.chdir(tmp_path)  # relative paths (export's DEST) land in the test's dir
    return seeded


def _run_main(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    from dsec_cli.cli import main

    monkeypatch.setattr(sys, "argv", ["dsec", *argv])
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # what a user would see as a traceback
        pytest.fail(f"dsec {argv!r:.200} raised:\n{traceback.format_exc()}")
    return 0


@pytest.mark.parametrize("argv,mentions", CASES,
                         ids=[f"{i}-{' '.join(a)[:40]!r}" for i, (a, _) in enumerate(CASES)])
def test_bad_input_exits_2_naming_it(argv: list[str], mentions: str, store: Path,
                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    before = _tree_digest(store)
    dest = tmp_path / "dest"  # where a store URL in the case points: never the host's root
    argv = [a.replace("@DEST@", str(dest)) for a in argv]
    code = _run_main(argv, monkeypatch)
    out, err = capfd.readouterr()
    assert code == 2, f"exit {code}\nstdout: {out[:2000]}\nstderr: {err[:2000]}"
    assert "Traceback" not in err
    assert mentions.lower() in err.lower(), err[:2000]
    assert len(err) < 5000, "the message repeats a huge input whole"
    assert _tree_digest(store) == before, "bad input changed the store"
    assert not (tmp_path / "config.yaml").exists(), "bad input changed the user config"
    assert not dest.exists(), "bad input created a store"


def _dsec(args: list[bytes], store: Path, tmp_path: Path) -> subprocess.CompletedProcess[bytes]:
    args = [a.replace(b"@DEST@", os.fsencode(tmp_path / "dest")) for a in args]
    env = {**os.environ, "DSEC_STORE": store.as_uri(), "COLUMNS": "200",
           "DSEC_CONFIG": str(tmp_path / "config.yaml")}
    return subprocess.run([sys.executable.encode(), b"-m", b"dsec_cli", *args],
                          capture_output=True, cwd=REPO, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args", [
    [b"inspect", b"a\xff@1"],
    [b"push", b"a@1", b"--to", b"file://@DEST@/\xff"],
    [b"cp", b"/etc/hostname", b"x\xfe:/a"],
    [b"node", b"add", b"n\xff", b"root@h", b"--no-check"],
    [b"exec", b"abc", b"--", b"echo", b"\xff"],
], ids=["ref", "url", "cp", "node", "command"])
def test_arguments_that_are_not_utf8(args: list[bytes], store: Path, tmp_path: Path) -> None:
    before = _tree_digest(store)
    p = _dsec(args, store, tmp_path)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2 and "not valid UTF-8" in err and "Traceback" not in err, err
    assert _tree_digest(store) == before and not (tmp_path / "config.yaml").exists()
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("args", [["inspect", LONG], ["exec", LONG, "--", "true"],
                                  ["push", LONG, "--to", "file://@DEST@"]])
def test_huge_argument_gets_a_short_message(args: list[str], store: Path,
                                            tmp_path: Path) -> None:
    p = _dsec([a.encode() for a in args], store, tmp_path)
    err = p.stderr.decode()
    assert p.returncode == 2 and "Traceback" not in err and "aaaa" in err
    assert len(err) < 5000, f"{len(err)} characters of error"


@pytest.mark.parametrize("call", [
    lambda: validate.ref("a@1\x00"),
    lambda: validate.ref("\udcff@1"),
    lambda: validate.sandbox_id("n1/abc\x00"),
    lambda: validate.node_name("n\x00"),
    lambda: validate.store_url("file:///tmp/\x00x"),
    lambda: validate.size("1\x00G"),
    lambda: validate.duration("nan"),
    lambda: validate.positive_float(float("nan"), "cpus"),
    lambda: validate.positive_int(True, "pids"),
], ids=["ref", "surrogate", "sandbox", "node", "url", "size", "duration", "cpus", "bool"])
def test_sdk_validators_refuse_nul_and_nonsense(call: object) -> None:
    """NUL cannot reach argv, but it can reach the SDK: the same checks refuse it."""
    with pytest.raises(UsageError):
        call()  # type: ignore[operator]


def test_sdk_push_refuses_bad_refs_before_touching_a_store(store: Path, tmp_path: Path) -> None:
    from dsec_cli.push import api

    dst = tmp_path / "dst"
    for refs, to in ((["a@1\x00"], dst.as_uri()), (["a@1"], ""), (["a@1"], "s3://b\n")):
        with pytest.raises(UsageError):
            api.push(refs, to)
    assert not dst.exists()


@pytest.mark.parametrize("kwargs", [
    {"image": ""}, {"image": "a@1\n"}, {"image": "a@1", "cpus": float("nan")},
    {"image": "a@1", "memory": "nan"}, {"image": "a@1", "ttl": "-1h"},
    {"image": "a@1", "pids": 0}, {"image": "a@1", "node": ""},
], ids=["empty", "newline", "cpus", "memory", "ttl", "pids", "node"])
def test_sdk_sandbox_refuses_bad_options(kwargs: dict[str, object], store: Path) -> None:
    from dsec_cli.api.sandboxes import Sandbox

    image = kwargs.pop("image")
    try:
        made = Sandbox(image, **kwargs)  # type: ignore[arg-type]
    except UsageError:
        pass
    else:
        made.remove()  # accepted: leave nothing behind, then fail
        pytest.fail(f"Sandbox({image!r}, **{kwargs!r}) was created")
    with pytest.raises(UsageError):
        Sandbox.attach("a\nb")
