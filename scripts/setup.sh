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
# The compiled parts (build walker, tar header decoder, lazy mounts' request loop): Python's headers.
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
# editable as a plain path line in a .pth file, not setuptools' import-hook finder: importing
# the finder (and the pathlib it loads) cost every dsec call about 15 ms of start-up
stamp=".venv/.installed$extra-path"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".$extra" -c scripts/constraints.txt \
    --config-settings editable_mode=compat
  touch "$stamp"
fi

# Compiled parts, each optional (without it the same work runs in Python): one gcc call per
# source against Python's headers, redone when the source is newer than its module.
ext_suffix=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
pyinc=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
build_ext() {  # SOURCE.c WHAT-RUNS-WITHOUT-IT
  local src=$1 so=${1%.c}$ext_suffix
  if [ ! -f "$so" ] || [ "$src" -nt "$so" ]; then
    if gcc -O2 -Wall -shared -fPIC -I"$pyinc" -o "$so.tmp" "$src"; then
      mv "$so.tmp" "$so"
    else
      echo "warning: $src did not build; $2" >&2
    fi
  fi
}
# the build walker: a sorted lstat walk and batched reads outside per-file Python
build_ext dsec_cli/format/_walk.c "builds use the Python walk"
# content-defined cut points without the GIL: compression runs while a large file is cut
build_ext dsec_cli/format/_cdc.c "builds cut with fastcdc's generator"
# index entries as canonical JSON straight from the entries (builds and imports)
build_ext dsec_cli/format/_entryjson.c "index entries are written as JSON in Python"
# the tar header decoder: `dsec import` reads each layer member's header in one call
build_ext dsec_cli/build/_tarhdr.c "imports use tarfile's parser"
# the chunks a store holds, in one table: a library's millions of chunks loaded in tens of
# milliseconds and tens of bytes each (docs/architecture.md, `dedup.py`)
build_ext dsec_cli/push/_known.c "known chunks are held as Python tuples in a dict"
# the request loop of kernel-served lazy mounts: a walk's per-file requests (opens, small
# files' reads, listings, releases) answered without Python (docs/lazy.md)
build_ext dsec_cli/run/lazy/_fuseloop.c "lazy mounts use the Python loop"

# Byte code for the package, as an installed wheel has it: an editable install otherwise
# leaves it to the first import, and where PYTHONDONTWRITEBYTECODE is set every dsec call
# compiled each module it imports again (about 70 ms of each call's start-up here).
.venv/bin/python -m compileall -q -j 0 dsec_cli >/dev/null

# The in-sandbox exec server: static, so it runs in any image (docs/agent.md).
agent_src=dsec_cli/backends/sandbox_agent/dsec-agent.c
agent_tag=$(sha256sum "$agent_src" | cut -c1-12)
if [ ! -x dsec_cli/backends/sandbox_agent/dsec-agent ] || [ "$(cat dsec_cli/backends/sandbox_agent/.dsec-agent.tag 2>/dev/null)" != "$agent_tag" ]; then
  gcc -static -O2 -o dsec_cli/backends/sandbox_agent/dsec-agent "$agent_src"
  echo "$agent_tag" > dsec_cli/backends/sandbox_agent/.dsec-agent.tag
fi

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
