"""python -m benchmarks NAME [options]   (NAME: a module benchmarks/bench_NAME.py)"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> None:
    names = sorted(m.name.removeprefix("bench_") for m in pkgutil.iter_modules(
        [str(Path(__file__).parent)]) if m.name.startswith("bench_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        print(f"usage: python -m benchmarks {{{','.join(names)}}} [options]", file=sys.stderr)
        sys.exit(2)
    mod = importlib.import_module(f"benchmarks.bench_{sys.argv[1]}")
    mod.main(sys.argv[2:])


main()
