"""The grader plane: scoring-fork overhead and history scrubbing.

    python -m benchmarks grader [--runs 5] [--commits 3000]

1. Fork overhead (container backend): the calc task of tests/grader (this machine's python,
   pytest and git; no download). Direct: the grader's command run in a sandbox of the grader
   image that already holds the fix (what grading in place costs). Fork: `Sandbox.grade` from
   an agent sandbox holding the fix (diff read, fork created, patch applied, the same
   command, fork removed). The figure is the difference of the medians.
2. History scrub: a repository of ``--commits`` commits over 200 files (made with
   `git fast-import`, then packed by `git gc`), reduced to its HEAD by `gitscrub.scrub`:
   time, and `.git` bytes before and after.

Results: benchmarks/results/grader.json (quoted in docs/grader.md).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import REPO, du, save


def _fast_import_stream(commits: int, seed: int = 7) -> bytes:
    rnd = random.Random(seed)
    out = []
    for i in range(1, commits + 1):
        name = f"src/mod{rnd.randrange(200):03d}.py"
        body = "".join(f"x_{i}_{k} = {rnd.random()!r}\n" for k in range(40)).encode()
        msg = f"change {i}".encode()
        out.append(b"commit refs/heads/main\n")
        out.append(f"committer dev <dev@example.com> {1_600_000_000 + i} +0000\n".encode())
        out.append(f"data {len(msg)}\n".encode() + msg + b"\n")
        out.append(f"M 100644 inline {name}\ndata {len(body)}\n".encode() + body + b"\n")
    return b"".join(out)


def bench_scrub(commits: int) -> dict[str, Any]:
    from dsec_cli.build.gitscrub import check, scrub

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        repo = root / "repo"
        repo.mkdir(parents=True)
        env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": tmp}
        subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True, env=env)
        subprocess.run(["git", "-C", str(repo), "fast-import", "--quiet"], check=True,
                       input=_fast_import_stream(commits), env=env)
        subprocess.run(["git", "-C", str(repo), "checkout", "-q", "main"], check=True, env=env)
        subprocess.run(["git", "-C", str(repo), "gc", "-q"], check=True, env=env)
        before = du(repo / ".git")
        t = time.perf_counter()
        scrub(root, "/repo", "HEAD")
        seconds = time.perf_counter() - t
        after = du(repo / ".git")
        assert check(root, "/repo").clean
        return {"commits": commits, "files": 200, "git_bytes_before": before,
                "git_bytes_after": after, "saved_bytes": before - after,
                "scrub_seconds": round(seconds, 3)}


def bench_fork(runs: int) -> dict[str, Any]:
    from dsec_cli.api.sandboxes import Sandbox
    from dsec_cli.build.builder import build
    from tests.grader import conftest as task
    from tests.grader.gitrepos import repo_with_history, tar_dir
    from tests.grader.pyimage import python_tar

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for var, sub in (("DSEC_STATE_DIR", "state"), ("XDG_DATA_HOME", "data"),
                         ("XDG_CONFIG_HOME", "config")):
            (base / sub).mkdir()
            os.environ[var] = str(base / sub)
        specs = base / "specs"
        specs.mkdir()
        subprocess.run(["bash", str(REPO / "layerspecs/busybox/make-rootfs.sh")], check=True)
        python_tar(specs / "python.tar")
        repo = base / "work" / "testbed"
        repo_with_history(repo, {"calc.py": task.BUGGY, "tests/test_calc.py": task.VISIBLE_TEST})
        tar_dir(repo, specs / "repo.tar", "testbed")
        (specs / "hidden").mkdir()
        shutil.copy(REPO / "tests/grader/task/hidden_tests.py",
                    specs / "hidden" / "test_hidden.py")
        shutil.copy(REPO / "tests/grader/task/oracle_calc.py", specs / "hidden")
        shutil.copy(REPO / "tests/grader/task/pytest.ini", specs / "pytest.ini")
        for name, text in task.SPECS.items():
            (specs / f"{name}.yaml").write_text(text)
        os.environ["DSEC_STORE"] = (base / "store").as_uri()
        build([REPO / "layerspecs/busybox/busybox.yaml",
               *[specs / f"{n}.yaml" for n in task.SPECS]], os.environ["DSEC_STORE"])
        command = task.SPECS["calc-grader"].split("command: >-\n", 1)[1].split("  results:")[0]
        command = " ".join(command.split())
        direct, forked = [], []
        with Sandbox(task.GRADER) as ref:
            ref.write_file("/testbed/calc.py", task.GOLD)
            for _ in range(runs):
                r = ref.exec(command, timeout=300)
                assert r.exit_code == 0, r.stdout
                direct.append(r.duration)
        with Sandbox(task.TASK) as sb:
            sb.write_file("/testbed/calc.py", task.GOLD)
            for _ in range(runs):
                res = sb.grade(task.GRADER)
                assert res.reward == 1.0, res.log
                forked.append(res.duration)
        return {"runs": runs, "direct_s": [round(x, 3) for x in direct],
                "fork_s": [round(x, 3) for x in forked],
                "direct_p50_s": round(statistics.median(direct), 3),
                "fork_p50_s": round(statistics.median(forked), 3),
                "overhead_p50_ms": round(1000 * (statistics.median(forked)
                                                 - statistics.median(direct)), 1)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks grader")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--commits", type=int, default=3000)
    a = p.parse_args(argv)
    out = {"scrub": bench_scrub(a.commits), "fork": bench_fork(a.runs)}
    print(save("grader", out))
    print(out)
