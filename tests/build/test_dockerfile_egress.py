"""A Dockerfile RUN reaches only the hosts of the build's egress allowlist (`build_egress`,
enforced by backends/egress.py in a network namespace made for the RUN), `--network=host`
bypasses it, `--network=none` has no network, and nothing of the allowlist (namespace, veth,
iptables chains, relay) outlives the RUN, whether it succeeded or failed.

The allowed host is this machine's Debian mirror, read from apt's sources; the blocked one is
PyPI's address, which the host itself reaches (so only the allowlist can be what stops it)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dsec_cli.backends import egress_proxy

from . import test_dockerfile
from .test_dockerfile import build, dockerfile, run_in

debian_store = test_dockerfile.debian_store  # the Debian minbase store, for this module too
deb_store = test_dockerfile.deb_store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="RUN needs root (overlayfs)")


def mirror_host() -> str:
    """The host of the first Debian archive apt's sources name (deb.debian.org if none)."""
    texts = []
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            texts.append(p.read_text())
        except OSError:
            continue
    for url in re.findall(r"(?m)^\s*(?:URIs:|deb)\s+(?:\[[^]]*\]\s+)?(https?://\S+)",
                          "\n".join(texts)):
        parts = urlsplit(url)
        if parts.hostname and parts.path.rstrip("/").endswith("/debian"):
            return parts.hostname
    return "deb.debian.org"


def used_links(stderr: str) -> set[str]:
    """The allowlists' links a build made, from its log (DSEC_LOG=INFO)."""
    return set(re.findall(r"egress of dse([0-9a-f]{9})", stderr))


def leftovers(links: set[str]) -> set[str]:
    """What of the allowlists of ``links`` is still on the host: links, namespaces, chains,
    relays (only these: others may be making allowlists on this host meanwhile)."""
    out: set[str] = set()
    found = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    rules = "\n".join(subprocess.run(argv, capture_output=True, text=True).stdout
                      for argv in (["iptables-save"], ["iptables-save", "-t", "nat"],
                                   ["ip6tables-save"]))
    relays = []
    for d in os.listdir("/proc"):
        try:
            relays.append(Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace"))
        except OSError:
            continue
    for h in links:
        out |= {f"link {h}" for text in (found,) if re.search(rf"\bds[ep]{h}\b", text)}
        out |= {f"netns {h}" for ln in ns.splitlines() if ln.startswith(f"dsec-{h}")}
        out |= {f"rule {ln}" for ln in rules.splitlines() if f"DSEC-{h}" in ln}
        out |= {f"relay {h}" for c in relays if egress_proxy.MODULE in c and h in c}
    return out


PROBE = ("exec 3<>/dev/tcp/{host}/{port} && printf 'HEAD /debian/ HTTP/1.0\\r\\nHost: {host}"
         "\\r\\n\\r\\n' >&3 && head -c 12 <&3")


@pytest.fixture
def egress_env(monkeypatch: pytest.MonkeyPatch) -> str:
    host = mirror_host()
    monkeypatch.setenv("DSEC_BUILD_EGRESS", f"{host}:80")
    return host


def test_run_reaches_the_allowlist_only_and_leaves_nothing(
        tmp_path: Path, run_dsec, deb_store: str, egress_env: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_LOG", "INFO")  # the log names each RUN's link
    mirror = egress_env
    pypi = socket.gethostbyname("pypi.org")  # reached by the host, not on the list
    ok = dockerfile(tmp_path / "ok", f"""\
FROM debian@1
SHELL ["/bin/bash", "-c"]
RUN {PROBE.format(host=mirror, port=80)} > /mirror
RUN --network=host timeout 10 bash -c 'exec 3<>/dev/tcp/{pypi}/443' && echo open > /host
CMD ["cat", "/mirror", "/host"]
""")
    made = run_dsec("build", str(ok), "--as", "egress-ok@1", "--store", deb_store)
    links = used_links(made.stderr)
    assert len(links) == 1, made.stderr  # the default RUN's; --network=host makes none
    out = run_in(run_dsec, deb_store, "egress-ok@1")
    assert out.startswith("HTTP/1.") and out.rstrip().endswith("open"), out
    assert not leftovers(links)

    for name, line in [(f"RUN timeout 5 bash -c 'exec 3<>/dev/tcp/{pypi}/443'", 3),
                       (f"RUN timeout 5 bash -c 'exec 3<>/dev/tcp/{mirror}/443'", 3),
                       (f"RUN --network=none {PROBE.format(host=mirror, port=80)}", 3)]:
        bad = dockerfile(tmp_path / f"bad{abs(hash(name))}", "FROM debian@1\n"
                         f'SHELL ["/bin/bash", "-c"]\n{name}\n')
        out = build(run_dsec, deb_store, bad, "egress-bad@1", check=1)
        assert f"Dockerfile:{line}" in out["stderr"], out["stderr"]
        links = used_links(out["stderr"])
        assert len(links) == (0 if "--network=none" in name else 1), out["stderr"]
        assert not leftovers(links)
    assert not (Path(deb_store) / "refs/egress-bad").exists()


def test_a_bad_rule_is_refused_before_anything_is_built(
        tmp_path: Path, run_dsec, deb_store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from .conftest import store_snapshot

    monkeypatch.setenv("DSEC_BUILD_EGRESS", "pypi.org:443,no_such:host")
    path = dockerfile(tmp_path / "ctx", "FROM debian@1\nRUN true\n")
    snap = store_snapshot(Path(deb_store))
    out = build(run_dsec, deb_store, path, "x@1", check=2)
    assert "DSEC_BUILD_EGRESS" in out["stderr"] and "no_such:host" in out["stderr"], out
    assert store_snapshot(Path(deb_store)) == snap
