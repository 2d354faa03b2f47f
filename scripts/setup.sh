#!/usr/bin/env bash
# Installs what dsec needs on a Debian machine, idempotently:
#   system packages (apt-get, only those missing), a virtualenv in .venv/, the package.
# Usage: scripts/setup.sh [--dev]     (--dev adds test tools and the test servers)
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
[ "${1:-}" = "--dev" ] && DEV=1

# Runtime: sandboxes (bubblewrap, runc), the example base layer (busybox-static), zstd.
PKGS=(bubblewrap runc busybox-static zstd ca-certificates gcc libc6-dev)
# Tests: the real servers and peers they start.
DEV_PKGS=(docker-registry openssh-server openssh-client)

want=("${PKGS[@]}")
[ "$DEV" = 1 ] && want+=("${DEV_PKGS[@]}")
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extra=""; [ "$DEV" = 1 ] && extra="[dev]"
stamp=".venv/.installed$extra"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".$extra"
  touch "$stamp"
fi

# The in-sandbox exec server: static, so it runs in any image (docs/agent.md).
agent_src=dsec_cli/agent/dsec-agent.c
agent_tag=$(sha256sum "$agent_src" | cut -c1-12)
if [ ! -x dsec_cli/agent/dsec-agent ] || [ "$(cat dsec_cli/agent/.dsec-agent.tag 2>/dev/null)" != "$agent_tag" ]; then
  gcc -static -O2 -o dsec_cli/agent/dsec-agent "$agent_src"
  echo "$agent_tag" > dsec_cli/agent/.dsec-agent.tag
fi
# The example base layer's root filesystem, made from the installed busybox-static.
layerspecs/busybox/make-rootfs.sh
