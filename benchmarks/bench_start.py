"""Start-up: what a `dsec` process costs over Python's own start, and a cluster fan-out
over nodes whose node services are resident vs started per connection.

    python -m benchmarks start [--runs 10] [--nodes 8] [--skip-cluster] [--skip-cli]
                               [--creates 200 --clients 16] [--skip-creates]

1. CLI, on this machine, interleaved run by run (medians of wall and of CPU time):
   ``python -c pass`` (the floor), ``dsec --help``, ``dsec exec ID -- true`` on a warm
   container in-process through the fast launcher (``DSEC_CLI_SERVER=0``), through the typer
   application (as every command ran before), and through the command server (the default),
   and ``dsec ps --json`` in-process. Overhead = the command's median minus the floor's.
   Then ``--creates`` ``dsec run -d`` from ``--clients`` shell clients at once, each running
   its share one after another: wall time in-process (``DSEC_CLI_SERVER=0``, the fast
   launcher) and with the command server started on demand (the default; no server at the
   start, so its own start is counted).
2. Cluster: ``--nodes`` sshd nodes on loopback (tests/cluster/sshnodes.py); ``dsec ps
   --all-nodes --json`` warm (masters and services up), with the resident node services
   (the default) and with a ``dsec agent --stdio`` session per node and call
   (``DSEC_NODE_AGENT=stdio``, as before), interleaved.

Results: benchmarks/results/start.json (quoted in docs/benchmarks.md). The machine is shared:
run it briefly and read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import REPO, save

sys.path.insert(0, str(REPO))
TYPER = ("import sys; sys.argv = ['dsec', *sys.argv[1:]]; "
         "from dsec_cli.cli.group import app; app()")


def _one(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system of the child) seconds of one run."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _interleaved(cases: dict[str, tuple[list[str], dict[str, str]]], runs: int
                 ) -> dict[str, dict[str, float]]:
    walls: dict[str, list[float]] = {k: [] for k in cases}
    cpus: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(runs):
        for name, (argv, env) in cases.items():
            w, c = _one(argv, env)
            walls[name].append(w)
            cpus[name].append(c)
    return {k: {"wall_ms": statistics.median(walls[k]) * 1e3,
                "cpu_ms": statistics.median(cpus[k]) * 1e3, "n": runs} for k in cases}


def _servers(runtime: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f"{runtime}/cli/".encode() in f.read():
                        out.append(int(d))
            except OSError:
                continue
    return out


def cli(runs: int) -> dict[str, Any]:
    from tests.cluster.conftest import IMAGE, _build_store

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-start-"))
    runtime = tempfile.mkdtemp(prefix="dsec-r-", dir="/tmp")
    data = root / "data"
    data.mkdir()
    url = _build_store(root, data)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSEC_STORE": url, "XDG_DATA_HOME": str(data),
           "XDG_CONFIG_HOME": str(root / "config"), "DSEC_STATE_DIR": str(root / "state"),
           "DSEC_RUNTIME_DIR": runtime}
    env["DSEC_CLI_SERVER"] = "0"  # in-process; the served case leaves it unset (the default)
    py = sys.executable
    sid = subprocess.run([py, "-m", "dsec_cli", "run", "-d", IMAGE], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    served = {k: v for k, v in env.items() if k != "DSEC_CLI_SERVER"}
    try:
        exec_argv = ["exec", sid, "--", "true"]
        for _ in range(3):  # warm: page cache, the sandbox's exec server, the command server
            _one([py, "-m", "dsec_cli", *exec_argv], served)
            time.sleep(0.5)
        cases = {
            "python -c pass": ([py, "-c", "pass"], env),
            "dsec --help": ([py, "-m", "dsec_cli", "--help"], env),
            "dsec exec (fast launcher, in-process)": ([py, "-m", "dsec_cli", *exec_argv], env),
            "dsec exec (typer)": ([py, "-c", TYPER, *exec_argv], env),
            "dsec exec (command server)": ([py, "-m", "dsec_cli", *exec_argv], served),
            "dsec ps --json": ([py, "-m", "dsec_cli", "ps", "--json"], env),
        }
        out = _interleaved(cases, runs)
    finally:
        for pid in _servers(runtime):
            os.kill(pid, signal.SIGKILL)
        subprocess.run([py, "-m", "dsec_cli", "rm", sid], env=env, check=False,
                       capture_output=True)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    floor = out["python -c pass"]
    for k, v in out.items():
        v["overhead_wall_ms"] = v["wall_ms"] - floor["wall_ms"]
        v["overhead_cpu_ms"] = v["cpu_ms"] - floor["cpu_ms"]
        print(f"{k:28} wall {v['wall_ms']:6.0f} ms (+{v['overhead_wall_ms']:4.0f})   "
              f"cpu {v['cpu_ms']:5.0f} ms (+{v['overhead_cpu_ms']:4.0f})", flush=True)
    return out


def creates(n: int, clients: int) -> dict[str, Any]:
    """n `dsec run -d` from `clients` shell loops at once, in-process and served."""
    from tests.cluster.conftest import IMAGE, _build_store

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-creates-"))
    runtime = tempfile.mkdtemp(prefix="dsec-r-", dir="/tmp")
    data = root / "data"
    data.mkdir()
    url = _build_store(root, data)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSEC_STORE": url, "XDG_DATA_HOME": str(data),
           "XDG_CONFIG_HOME": str(root / "config"), "DSEC_STATE_DIR": str(root / "state"),
           "DSEC_RUNTIME_DIR": runtime}
    env.pop("DSEC_CLI_SERVER", None)
    py = sys.executable
    subprocess.run([py, "-m", "dsec_cli", "rm", subprocess.run(
        [py, "-m", "dsec_cli", "run", "-d", IMAGE], env={**env, "DSEC_CLI_SERVER": "0"},
        check=True, capture_output=True, text=True).stdout.strip()], env=env, check=True,
        capture_output=True)  # the layer in the node's cache

    def burst(e: dict[str, str]) -> float:
        share = [n // clients + (i < n % clients) for i in range(clients)]
        t = time.perf_counter()
        procs = [subprocess.Popen(["bash", "-c", f'for i in $(seq {k}); do "$0" -m dsec_cli '
                                   f'run -d {IMAGE} >/dev/null || exit 1; done', py], env=e)
                 for k in share]
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - t
        assert codes == [0] * clients, codes
        ids = subprocess.run([py, "-m", "dsec_cli", "ps", "--json"], env=e, check=True,
                             capture_output=True, text=True).stdout
        import json

        sids = [r["id"] for r in json.loads(ids)]
        assert len(sids) == n, len(sids)
        subprocess.run([py, "-m", "dsec_cli", "rm", *sids], env=e, check=True,
                       capture_output=True)
        return wall

    out: dict[str, Any] = {"creates": n, "clients": clients}
    try:
        out["in_process_s"] = burst({**env, "DSEC_CLI_SERVER": "0"})
        out["served_s"] = burst(env)
    finally:
        for pid in _servers(runtime):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    out["ratio"] = out["in_process_s"] / out["served_s"]
    print(f"{n} run -d from {clients} clients: in-process {out['in_process_s']:.1f} s, "
          f"command server {out['served_s']:.1f} s ({out['ratio']:.1f}x)", flush=True)
    return out


def cluster(nodes: int, runs: int) -> dict[str, Any]:
    from tests.cluster.conftest import _build_store
    from tests.cluster.sshnodes import destroy_cluster, make_cluster

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-fanout-"))
    data = root / "data"
    data.mkdir()
    url = _build_store(root, data)
    c = make_cluster(root / "nodes", url, data, nodes)
    env = {**os.environ, **c.client_env(), "PYTHONPATH": str(REPO),
           "XDG_CONFIG_HOME": str(root / "home" / "config"),
           "XDG_DATA_HOME": str(root / "home" / "data"), "DSEC_STORE": url}
    env.pop("DSEC_CLI_SERVER", None)
    old = {k: os.environ.get(k) for k in ("XDG_CONFIG_HOME", "DSEC_CONFIG")}
    os.environ["XDG_CONFIG_HOME"] = env["XDG_CONFIG_HOME"]
    os.environ.pop("DSEC_CONFIG", None)
    try:
        from dsec_cli.core.config import save_user_config

        save_user_config({"nodes": c.config_nodes()})
        py = sys.executable
        ps = [py, "-m", "dsec_cli", "ps", "--all-nodes", "--json"]
        stdio = {**env, "DSEC_NODE_AGENT": "stdio"}
        for e in (env, stdio):  # warm: masters, resident services, page cache
            _one(ps, e)
        out: dict[str, Any] = {"nodes": nodes}
        res = _interleaved({"resident": (ps, env), "stdio": (ps, stdio)}, runs)
        out.update(res)
        out["stdio_over_resident"] = res["stdio"]["wall_ms"] / res["resident"]["wall_ms"]
        print(f"ps --all-nodes over {nodes} nodes: resident {res['resident']['wall_ms']:.0f} ms,"
              f" stdio sessions {res['stdio']['wall_ms']:.0f} ms "
              f"({out['stdio_over_resident']:.1f}x)", flush=True)
        return out
    finally:
        destroy_cluster(c)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks start")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--creates", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--skip-creates", action="store_true")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("needs root (sandboxes and sshd)")
    import json

    from .common import RESULTS

    prev = RESULTS / "start.json"  # a partial run keeps the other part's last figures
    out: dict[str, Any] = {k: v for k, v in (json.loads(prev.read_text()) if prev.is_file()
                                             else {}).items() if k in ("cli", "fanout", "creates")}
    out.update({"load_average_at_start": os.getloadavg()[0], "runs": a.runs})
    if not a.skip_cli:
        out["cli"] = cli(a.runs)
    if not a.skip_creates:
        out["creates"] = creates(a.creates, a.clients)
    if not a.skip_cluster:
        out["fanout"] = cluster(a.nodes, max(3, a.runs // 2))
    print(save("start", out))
