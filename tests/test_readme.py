"""README.md's "Using it" commands, run for real so the README cannot drift: every command of
that block is looked up in COMMANDS (the exact README text -> the argvs it runs as, with its
placeholders given real values and each optional part and alternative expanded), and each
argv is run with the installed `dsec` in a fresh clone of this repository, against real
servers on loopback (moto S3, Debian's docker-registry, an sshd node)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec_cli.push import testing
from tests.cluster.sshnodes import SshCluster, destroy_cluster, make_cluster
from tests.conftest import node_env_of
from tests.oci.helpers import base_image, skopeo, write_layout

REPO = Path(__file__).resolve().parents[1]
DSEC = str(Path(sys.executable).with_name("dsec"))
MICROVM = "dsec run -d demo@1 --backend microvm"

# README text -> the commands it runs as. `{name}` is a value of the environment (Readme.vars:
# ids the commands printed, server addresses, paths); a leading `VAR=value` sets that
# variable for the one command; `later:` runs it at the end of its section. The registry is
# plain HTTP, so its commands add --insecure
# (or `?insecure=1` in the URL, for the form without the flag).
COMMANDS: dict[str, list[str]] = {
    # layers
    "dsec build": ["dsec build"],
    "dsec build layerspecs/tools --json": ["dsec build layerspecs/tools --json"],
    "dsec ls [layers|images]": ["dsec ls", "dsec ls layers", "dsec ls images"],
    "dsec inspect demo@1 [--files]": ["dsec inspect demo@1", "dsec inspect demo@1 --files"],
    "dsec export demo@1 ./rootfs": ["dsec export demo@1 ./rootfs"],
    "dsec import registry.example.com/swe/task:1 --as task@1":
        ["dsec import {registry}/swe/task:1 --as task@1 --insecure"],
    "dsec import reg.example.com/swe/t1:1 reg.example.com/swe/t2:1":
        ["dsec import {registry}/swe/t1:1 {registry}/swe/t2:1 --insecure"],
    "dsec export demo@1 --format oci ./demo-oci": ["dsec export demo@1 --format oci ./demo-oci"],
    # distribution
    "dsec push demo@1 --to s3://bucket/prefix --endpoint-url http://minio:9000":
        ["dsec push demo@1 --to s3://{bucket}/prefix --endpoint-url {s3}"],
    "dsec pull demo@1 --from oci://registry:5000/envs [--insecure]":
        ["DSEC_STORE={fresh1} dsec pull demo@1 --from oci://{registry}/envs?insecure=1",
         "DSEC_STORE={fresh2} dsec pull demo@1 --from oci://{registry}/envs --insecure"],
    "dsec rmi old@1": ["dsec rmi old@1"],
    "dsec gc --grace 1h": ["dsec gc --grace 1h"],
    "dsec verify --deep": ["dsec verify --deep"],
    # sandboxes
    "dsec run demo@1 -- hello": ["dsec run demo@1 -- hello"],
    "dsec run -d demo@1 --memory 512M --pids 256 --disk 1G --ttl 2h":
        ["dsec run -d demo@1 --memory 512M --pids 256 --disk 1G --ttl 2h"],
    MICROVM: [MICROVM],
    "dsec exec ID -- sh -c 'echo hi > /tmp/x'": ["dsec exec {ID} -- sh -c 'echo hi > /tmp/x'"],
    "dsec cp ID:/tmp/x ./x": ["dsec cp {ID}:/tmp/x ./x"],
    "dsec ps": ["dsec ps"],
    "dsec snapshot ID --as mystate@1 [--push URL]":
        ["dsec snapshot {ID} --as mystate@1",
         # versions are immutable: a second snapshot is another version
         "dsec snapshot {ID} --as mystate@2 --push s3://{bucket}/snaps?endpoint_url={s3}"],
    "dsec pause ID": ["dsec pause {ID}"],
    "dsec resume ID": ["dsec resume {ID}"],
    "dsec rm ID": ["dsec rm {ID}"],
    "dsec gc --node": ["dsec gc --node"],
    "dsec run -d demo@1 --class latency": ["dsec run -d demo@1 --class latency"],
    "dsec park ID": ["dsec park {ID}"],
    "dsec thaw ID": ["dsec thaw {ID}"],
    "dsec top": ["dsec top"],
    "dsec pool set demo@1 --size 8 --memory 256M": ["dsec pool set demo@1 --size 8 --memory 256M"],
    # jobs
    "dsec job start train-1 --ttl 10m --max-concurrent 64":
        ["dsec job start train-1 --ttl 10m --max-concurrent 64"],
    "dsec run --job train-1 demo@1": ["dsec run --job train-1 demo@1"],
    "dsec job ls [train-1]": ["dsec job ls", "dsec job ls train-1"],
    "dsec job renew|park|thaw|rm train-1":
        ["dsec job renew train-1", "dsec job park train-1", "dsec job thaw train-1",
         "later: dsec job rm train-1"],  # after journal and replay: rm removes the journal
    "dsec journal ROLLOUT [--json]": ["dsec journal {ROLLOUT}", "dsec journal {ROLLOUT} --json"],
    "dsec replay ROLLOUT": ["dsec replay {ROLLOUT}"],
    # a cluster
    "dsec node add n1 root@10.0.0.1 --identity ~/.ssh/id_ed25519":
        ["dsec node add n1 {node_address} --identity {HOME}/.ssh/id_ed25519 --dsec " + DSEC],
    "dsec run -d demo@1 --node auto": ["dsec run -d demo@1 --node auto"],
    "dsec ps --all-nodes": ["dsec ps --all-nodes"],
}


def readme_sections() -> dict[str, list[str]]:
    """The commands of README.md's "Using it" block, by the `# section` comment above them:
    comments dropped, commands split where 4+ spaces or `&&` separate them."""
    text = (REPO / "README.md").read_text()
    body = text.split("\n## Using it\n", 1)[1]
    block = body.split("```sh\n", 1)[1].split("\n```", 1)[0]
    sections: dict[str, list[str]] = {}
    current = ""
    for line in block.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            current = line.lstrip("# ").split(":")[0]
            sections[current] = []
            continue
        line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
        for part in re.split(r"\s{4,}", line):
            sections[current].extend(c.strip() for c in part.split("&&"))
    return sections


def test_every_readme_command_is_in_the_table() -> None:
    listed = [c for cmds in readme_sections().values() for c in cmds]
    missing = [c for c in listed if c not in COMMANDS]
    gone = [c for c in COMMANDS if c not in listed]
    assert not missing, f"README commands with no entry in COMMANDS: {missing}"
    assert not gone, f"COMMANDS entries no longer in README.md: {gone}"
    assert len(listed) == len(set(listed)), "a README command is listed twice"


@dataclass
class Readme:
    """The module's environment: a clone, its dsec settings, the servers, and what the
    commands printed so far."""

    clone: Path
    env: dict[str, str]
    vars: dict[str, str]

    def dsec(self, *args: str, code: int = 0, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([DSEC, *args], capture_output=True, text=True, cwd=self.clone,
                           env={**self.env, **(env or {})}, timeout=600)
        assert p.returncode == code, (f"dsec {shlex.join(args)} exited {p.returncode}, "
                                      f"wanted {code}\nstdout:\n{p.stdout}\n"
                                      f"stderr:\n{p.stderr}")
        return p

    def run(self, text: str, later: bool = False) -> list[subprocess.CompletedProcess[str]]:
        """The commands README's ``text`` runs as (those marked `later:`, or the others)."""
        procs = []
        for template in COMMANDS[text]:
            if template.startswith("later: ") != later:
                continue
            words = shlex.split(template.removeprefix("later: ").format(**self.vars))
            env = {}
            while "=" in words[0]:
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            assert words[0] == "dsec"
            procs.append(self.dsec(*words[1:], env=env))
        return procs

    def section(self, name: str, checks: dict[str, Callable[[list[str]], None]],
                skip: tuple[str, ...] = ()) -> None:
        """Run a README section's commands in order, each followed by its check, then those
        marked `later:`."""
        texts = [t for t in readme_sections()[name] if t not in skip]
        for text in texts:
            outs = [p.stdout for p in self.run(text)]
            if text in checks:
                checks[text](outs)
        for text in texts:
            self.run(text, later=True)


@pytest.fixture(scope="module")
def readme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Readme]:
    if os.geteuid() != 0:
        pytest.skip("sandboxes and sshd need root")
    root = tmp_path_factory.mktemp("readme")
    clone = root / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run([str(clone / "layerspecs/busybox/make-rootfs.sh")], check=True, cwd=clone,
                   capture_output=True)
    data = root / "data"
    data.mkdir()
    store = (root / "store").as_uri()
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    from dsec_cli.backends.vm.vmkernel import cache_home

    kernel_cache = str(cache_home().parent)  # the guest kernel scripts/setup.sh fetched
    s3 = testing.start_moto()
    registry = testing.start_registry()
    node_env = node_env_of(tmp_path_factory, store, data)
    cluster: SshCluster | None = None
    try:
        env = {**os.environ, **next(node_env), **testing.S3_ENV, "HOME": str(home),
               "XDG_CACHE_HOME": kernel_cache, "DOCKER_CONFIG": str(home / ".docker"),
               "COLUMNS": "200"}
        for var in ("DSEC_DATA_DIR", "DSEC_CONFIG", "AWS_ENDPOINT_URL", "SOURCE_DATE_EPOCH"):
            env.pop(var, None)
        host = registry.url.removeprefix("http://")
        layout = root / "oci-layout"
        write_layout(base_image(), layout, tag="1")
        for name in ("task", "t1", "t2"):
            skopeo("copy", "--dest-tls-verify=false", f"oci:{layout}:1",
                   f"docker://{host}/swe/{name}:1")
        testing.create_bucket(s3.url, "bucket")
        cluster = make_cluster(root / "cluster", store, root / "node-data", 0)
        node = cluster.add_node("n1", root / "node-data")
        (home / ".ssh/id_ed25519").write_bytes(cluster.identity.read_bytes())
        (home / ".ssh/id_ed25519").chmod(0o600)
        (home / ".ssh/known_hosts").write_text(cluster.known_hosts.read_text())
        env.update(cluster.client_env())
        yield Readme(clone, env, {"registry": host, "s3": s3.url, "bucket": "bucket",
                                  "fresh1": (root / "fresh1").as_uri(),
                                  "fresh2": (root / "fresh2").as_uri(),
                                  "node_address": node.address, "HOME": str(home),
                                  "layout": str(layout), "state": env["DSEC_STATE_DIR"]})
    finally:
        if cluster is not None:
            destroy_cluster(cluster)
        next(node_env, None)  # removes every sandbox the node still holds
        s3.stop()
        registry.stop()


def _needs_demo(r: Readme) -> None:
    """demo@1 in the store, as the layers section leaves it (for a section run alone)."""
    if not Path(r.env["DSEC_STORE"].removeprefix("file://")).exists() \
            or "demo@1" not in _ls(r, "images"):
        r.dsec("build")


def _ls(r: Readme, *args: str, env: dict[str, str] | None = None) -> str:
    return r.dsec("ls", *args, env=env).stdout


def test_layers(readme: Readme) -> None:
    r = readme
    c = r.clone

    def built(outs: list[str]) -> None:
        assert "demo@1" in _ls(r, "images")

    def report(outs: list[str]) -> None:
        rep = json.loads(outs[0])
        assert "tools@1" in json.dumps(rep)

    def listed(outs: list[str]) -> None:
        assert all(x in outs[0] for x in ("demo@1", "busybox@1.35-1", "tools@1"))
        assert "tools@1" in outs[1] and "demo@1" in outs[2]

    def inspected(outs: list[str]) -> None:
        for out in outs:
            doc = json.loads(out)
            assert doc["manifest"]["name"] == "demo"
            assert [x["ref"] for x in doc["layers"]] == ["busybox@1.35-1", "tools@1", "webapp@1"]
        files = json.loads(r.dsec("inspect", "tools@1", "--files").stdout)["files"]
        assert any(f["path"].endswith("bin/hello") for f in files)

    def exported(outs: list[str]) -> None:
        assert (c / "rootfs/bin/busybox").exists()
        assert (c / "rootfs/opt/tools/bin/hello").exists()

    def imported(outs: list[str]) -> None:
        assert "task@1" in _ls(r)

    def library(outs: list[str]) -> None:
        ls = _ls(r)
        assert "t1@1" in ls and "t2@1" in ls

    def oci_layout(outs: list[str]) -> None:
        index = json.loads((c / "demo-oci/index.json").read_text())
        assert index["manifests"]
        skopeo("inspect", f"oci:{c / 'demo-oci'}")

    r.section("layers", {
        "dsec build": built, "dsec build layerspecs/tools --json": report,
        "dsec ls [layers|images]": listed, "dsec inspect demo@1 [--files]": inspected,
        "dsec export demo@1 ./rootfs": exported,
        "dsec import registry.example.com/swe/task:1 --as task@1": imported,
        "dsec import reg.example.com/swe/t1:1 reg.example.com/swe/t2:1": library,
        "dsec export demo@1 --format oci ./demo-oci": oci_layout})


def test_inspect_files_of_an_image(readme: Readme) -> None:
    _needs_demo(readme)
    doc = json.loads(readme.dsec("inspect", "demo@1", "--files").stdout)
    assert any(f["path"].endswith("bin/hello") for f in doc.get("files", []))


def test_distribution(readme: Readme) -> None:
    r = readme
    _needs_demo(r)
    # what the commands work on: demo@1 in the registry, an image old@1 to remove
    r.dsec("push", "demo@1", "--to", f"oci://{r.vars['registry']}/envs", "--insecure")
    r.dsec("import", f"{r.vars['layout']}:1", "--as", "old@1")

    def pushed(outs: list[str]) -> None:
        s3 = f"s3://bucket/prefix?endpoint_url={r.vars['s3']}"
        assert "demo@1" in _ls(r, "--store", s3)

    def pulled(outs: list[str]) -> None:
        for fresh in ("fresh1", "fresh2"):
            assert "demo@1" in _ls(r, env={"DSEC_STORE": r.vars[fresh]})

    def removed(outs: list[str]) -> None:
        assert "old@1" not in _ls(r)

    def collected(outs: list[str]) -> None:
        assert "demo@1" in _ls(r)

    r.section("distribution", {
        "dsec push demo@1 --to s3://bucket/prefix --endpoint-url http://minio:9000": pushed,
        "dsec pull demo@1 --from oci://registry:5000/envs [--insecure]": pulled,
        "dsec rmi old@1": removed, "dsec gc --grace 1h": collected})


def _ps(r: Readme) -> list[dict[str, object]]:
    out: list[dict[str, object]] = json.loads(r.dsec("ps", "--json").stdout)
    return out


def test_sandboxes(readme: Readme) -> None:
    r = readme
    _needs_demo(r)

    def hello(outs: list[str]) -> None:
        assert outs[0].startswith("hello from ") and "in /srv/www" in outs[0]
        assert "app at /srv/www" in outs[0]

    def detached(outs: list[str]) -> None:
        r.vars["ID"] = outs[0].strip()
        assert [s["id"] for s in _ps(r)] == [r.vars["ID"]]

    def limited(outs: list[str]) -> None:
        detached(outs)
        doc = json.loads(r.dsec("inspect", r.vars["ID"]).stdout)
        assert (doc["limits"]["memory"], doc["limits"]["pids"], doc["limits"]["disk"]) == \
            (512 << 20, 256, 1 << 30)
        assert abs(doc["expires"] - doc["created"] - 7200) < 10  # --ttl 2h

    def copied(outs: list[str]) -> None:
        assert (r.clone / "x").read_text() == "hi\n"

    def listed(outs: list[str]) -> None:
        assert r.vars["ID"] in outs[0]

    def snapshot(outs: list[str]) -> None:
        assert "mystate@1" in _ls(r)
        s3 = f"s3://bucket/snaps?endpoint_url={r.vars['s3']}"
        assert "mystate@2" in _ls(r, "--store", s3)

    def status(want: str) -> Callable[[list[str]], None]:
        def check(outs: list[str]) -> None:
            assert [s["status"] for s in _ps(r)] == [want]
        return check

    def gone(outs: list[str]) -> None:
        assert _ps(r) == []

    def top(outs: list[str]) -> None:
        assert r.vars["ID"] in outs[0]

    def pooled(outs: list[str]) -> None:
        pools = json.loads(r.dsec("pool", "ls", "--json").stdout)["pools"]
        assert [(p["image"], p["size"], p["ready"]) for p in pools] == [("demo@1", 8, 8)]
        # a matching create takes a member
        sid = r.dsec("run", "-d", "demo@1", "--memory", "256M").stdout.strip()
        r.dsec("rm", sid)

    r.section("sandboxes", {
        "dsec run demo@1 -- hello": hello,
        "dsec run -d demo@1 --memory 512M --pids 256 --disk 1G --ttl 2h": limited,
        "dsec cp ID:/tmp/x ./x": copied, "dsec ps": listed,
        "dsec snapshot ID --as mystate@1 [--push URL]": snapshot,
        "dsec pause ID": status("paused"), "dsec resume ID": status("running"),
        "dsec rm ID": gone, "dsec run -d demo@1 --class latency": detached,
        "dsec park ID": status("parked"), "dsec thaw ID": status("running"),
        "dsec top": top, "dsec pool set demo@1 --size 8 --memory 256M": pooled,
    }, skip=(MICROVM,))
    # what the section left: the --class latency sandbox and the pool's members
    r.dsec("rm", r.vars["ID"])
    r.dsec("pool", "drain")
    assert json.loads(r.dsec("pool", "ls", "--json").stdout)["pools"] == []
    assert _ps(r) == []


@pytest.mark.slow
def test_sandboxes_microvm(readme: Readme) -> None:
    """The microvm line of the sandboxes section: a QEMU guest under TCG."""
    from dsec_cli.backends.vm.vmkernel import default_kernel_dir

    if not (default_kernel_dir() / "vmlinuz").exists() and not os.environ.get("DSEC_KERNEL"):
        pytest.skip("no guest kernel: run scripts/setup.sh")
    assert MICROVM in readme_sections()["sandboxes"]
    _needs_demo(readme)
    vm = readme.run(MICROVM)[0].stdout.strip()
    try:
        assert [(x["id"], x["backend"]) for x in _ps(readme)] == [(vm, "microvm")]
        assert "hello" in readme.dsec("exec", vm, "--", "sh", "-c", "echo hello").stdout
    finally:
        readme.dsec("rm", vm)
    assert _ps(readme) == []


def test_jobs(readme: Readme) -> None:
    r = readme
    _needs_demo(r)

    def started(outs: list[str]) -> None:
        assert "train-1" in r.dsec("job", "ls").stdout

    def owned(outs: list[str]) -> None:
        r.vars["SANDBOX"] = outs[0].strip().split()[-1]
        # a journaled step for journal and replay to show and redo
        r.dsec("exec", r.vars["SANDBOX"], "--", "sh", "-c", "echo step > /tmp/step")
        rollouts = json.loads(r.dsec("job", "ls", "train-1", "--json").stdout)
        assert [x["sandbox"] for x in rollouts] == [r.vars["SANDBOX"]]
        r.vars["ROLLOUT"] = rollouts[0]["id"]

    def listed(outs: list[str]) -> None:
        assert "train-1" in outs[0] and r.vars["SANDBOX"] in outs[1]

    def journal(outs: list[str]) -> None:
        assert "echo step > /tmp/step" in outs[0]
        assert [s["argv"] for s in json.loads(outs[1])] == [["sh", "-c", "echo step > /tmp/step"]]

    def replayed(outs: list[str]) -> None:
        rebuilt = outs[0].split("rebuilt as sandbox ")[1].split()[0]
        assert r.dsec("exec", rebuilt, "--", "cat", "/tmp/step").stdout == "step\n"

    r.section("jobs", {
        "dsec job start train-1 --ttl 10m --max-concurrent 64": started,
        "dsec run --job train-1 demo@1": owned, "dsec job ls [train-1]": listed,
        "dsec journal ROLLOUT [--json]": journal, "dsec replay ROLLOUT": replayed})
    assert "train-1" not in r.dsec("job", "ls").stdout
    assert _ps(r) == []


def test_cluster(readme: Readme) -> None:
    r = readme
    _needs_demo(r)

    def placed(outs: list[str]) -> None:
        r.vars["ID"] = outs[0].strip()
        assert r.vars["ID"].startswith("n1/")

    def listed(outs: list[str]) -> None:
        assert r.vars["ID"].split("/")[-1] in outs[0]

    r.section("a cluster", {"dsec run -d demo@1 --node auto": placed,
                            "dsec ps --all-nodes": listed})
    r.dsec("rm", r.vars["ID"])
    assert r.vars["ID"].split("/")[-1] not in r.dsec("ps", "--all-nodes").stdout
    assert _ps(r) == []


def test_nothing_left(readme: Readme) -> None:
    """Every sandbox, pool member and job the commands made is gone."""
    from dsec_cli.run.node import Node

    assert _ps(readme) == []
    assert json.loads(readme.dsec("pool", "ls", "--json").stdout)["pools"] == []
    assert json.loads(readme.dsec("job", "ls", "--json").stdout) == []
    node = Node(Path(readme.env["DSEC_STATE_DIR"]), readme.env["DSEC_STORE"])
    assert [(x.id, x.status) for x in node.db.all()] == []
