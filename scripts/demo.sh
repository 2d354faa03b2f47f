#!/usr/bin/env bash
# The main job on the embedded default store: build the example layerspecs, list the
# store, export the demo image and show what is in it.
set -euo pipefail
cd "$(dirname "$0")/.."
dsec=.venv/bin/dsec

echo "== dsec build (layerspecs/ into the embedded store)"
$dsec build
echo
echo "== dsec build again (nothing changed: every layer is a cache hit)"
$dsec build
echo
echo "== dsec ls"
$dsec ls
echo
out=$(mktemp -d)/demo-rootfs
echo "== dsec export demo@1 $out"
$dsec export demo@1 "$out"
echo
echo "== the exported image: /opt/tools and /srv/www come from two layers over busybox"
ls -l "$out/opt/tools/bin" "$out/srv/www"
echo "/etc/motd removed by the webapp layer's run step: $([ -e "$out/etc/motd" ] && echo no || echo yes)"
rm -rf "$(dirname "$out")"
