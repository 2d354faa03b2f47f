"""Hidden tests of the calc task. The candidate runs in a child process as nobody: its
answer crosses back as text, so nothing it does to its own interpreter (patching pytest,
overriding __eq__, exiting early) reaches this process, and it cannot read these files."""

import subprocess
import sys

CHILD = "import sys; sys.path.insert(0, '/testbed'); import calc; r = {expr}; " \
        "print(type(r).__name__, repr(r))"


def call(expr: str) -> str:
    try:
        r = subprocess.run([sys.executable, "-I", "-S", "-c", CHILD.format(expr=expr)],
                           user=65534, group=65534, extra_groups=[], cwd="/testbed",
                           env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           timeout=20)
    except subprocess.TimeoutExpired:
        return "timeout"
    return r.stdout.strip() if r.returncode == 0 else f"exit {r.returncode}"


def test_add():
    assert call("calc.add(2, 3)") == "int 5"


def test_add_negative():
    assert call("calc.add(-7, 4)") == "int -3"


def test_add_big():
    assert call("calc.add(10**20, 1)") == f"int {10**20 + 1}"
