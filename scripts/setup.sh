#!/usr/bin/env bash
# Installs what dsec needs on a Debian machine, idempotently:
#   system packages (apt-get, only those missing), a virtualenv in .venv/, the package.
# Usage: scripts/setup.sh [--dev]     (--dev adds test tools and the test servers)
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
[ "${1:-}" = "--dev" ] && DEV=1

# Runtime: sandboxes (bubblewrap, runc), the example base layer (busybox-static), zstd,
# lazy layer mounts (fuse3: libfuse3 and fusermount3).
PKGS=(bubblewrap runc busybox-static zstd ca-certificates gcc libc6-dev fuse3)
# The compiled parts (build walker, tar header decoder, lazy mounts' request loop), built by
# the package install (setup.py): Python's headers.
PKGS+=(python3-dev)
# VM backends: QEMU (microvm, q35), guest root images (erofs-utils, e2fsprogs).
PKGS+=(qemu-system-x86 erofs-utils e2fsprogs)
# Cluster: the ssh client reaches nodes (docs/cluster.md); test nodes run openssh-server.
PKGS+=(openssh-client)
# Grader plane: git for `git_scrub` / `dsec git-check`, iproute2 and iptables for egress
# allowlists enforced on the host's side (docs/grader.md).
PKGS+=(git iproute2 iptables)
# Tests: the real servers and peers they start.
DEV_PKGS=(docker-registry openssh-server)
# OCI tests: peers that push, convert and unpack the OCI images dsec imports and exports.
DEV_PKGS+=(skopeo umoci)
# The grader suite's task image is made from Debian's own python3.11 (tests/grader/pyimage.py).
DEV_PKGS+=(python3.11)
# Benchmarks: peers measured side by side with dsec (casync: build; restic and casync:
# library size, benchmarks/bench_library.py).
DEV_PKGS+=(casync restic)
# Dockerfile tests and benchmark: a Debian base made by debootstrap, buildah (rootless, vfs)
# the peer of `dsec build Dockerfile`.
DEV_PKGS+=(debootstrap buildah)

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
# the stores' and lazy mounts' extras, which README's commands use (`--store s3://`, `oci://`)
extra="[s3,oci,lazy]"; [ "$DEV" = 1 ] && extra="[s3,oci,lazy,dev]"
# The install also builds the compiled parts (setup.py): the C modules in place beside their
# sources, each optional (without one the same work runs in Python; `dsec node check --host`
# says which are live), and the static in-sandbox agent (docs/agent.md); so it is redone when
# a C source or the build itself changes.
# editable as a plain path line in a .pth file, not setuptools' import-hook finder: importing
# the finder (and the pathlib it loads) cost every dsec call about 15 ms of start-up
stamp=".venv/.installed$extra-path"
newer() { [ -n "$(find "$@" -newer "$stamp" -print -quit)" ]; }
if [ ! -f "$stamp" ] || newer setup.py pyproject.toml scripts/constraints.txt \
    || newer dsec_cli -name '*.c'; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".$extra" -c scripts/constraints.txt \
    --config-settings editable_mode=compat
  touch "$stamp"
fi

# Byte code for the package, as an installed wheel has it: an editable install otherwise
# leaves it to the first import, and where PYTHONDONTWRITEBYTECODE is set every dsec call
# compiled each module it imports again (about 70 ms of each call's start-up here).
.venv/bin/python -m compileall -q -j 0 dsec_cli >/dev/null

# Guest kernel for the microvm/vm backends: Debian's linux-image-amd64, downloaded and
# unpacked into the user cache (never installed as the host kernel).
KCACHE="${XDG_CACHE_HOME:-$HOME/.cache}/dsec/kernel"
if [ "${DSEC_SKIP_KERNEL:-0}" != 1 ] && [ ! -e "$KCACHE/current/lib/modules" ]; then
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  if [ -z "$kpkg" ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
  echo "fetching guest kernel $kpkg into $KCACHE"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q "$kpkg" >/dev/null 2>&1 || apt-get download "$kpkg")
  mkdir -p "$KCACHE"
  rm -rf "$KCACHE/$kpkg.tmp" && mkdir "$KCACHE/$kpkg.tmp"
  dpkg-deb -x "$tmp"/*.deb "$KCACHE/$kpkg.tmp"
  mv "$KCACHE/$kpkg.tmp/boot/"vmlinuz-* "$KCACHE/$kpkg.tmp/vmlinuz"
  mv "$KCACHE/$kpkg.tmp/boot/"config-* "$KCACHE/$kpkg.tmp/config"
  rm -rf "$KCACHE/$kpkg.tmp/boot" "$KCACHE/$kpkg.tmp/usr" "$KCACHE/$kpkg" "$tmp"
  mv "$KCACHE/$kpkg.tmp" "$KCACHE/$kpkg"
  ln -sfn "$kpkg" "$KCACHE/current"
fi

# The example base layer's root filesystem, made from the installed busybox-static.
layerspecs/busybox/make-rootfs.sh
