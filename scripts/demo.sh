#!/usr/bin/env bash
# The main job on the embedded default store: build the example layerspecs, list the
# store, export the demo image, and run sandboxes from it.
set -euo pipefail
cd "$(dirname "$0")/.."
dsec=.venv/bin/dsec

echo "== layerspecs/busybox/busybox-rootfs.tar: made by make-rootfs.sh from the installed busybox-static"
layerspecs/busybox/make-rootfs.sh
echo
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
echo
echo "== dsec run demo@1 -- hello   (a container sandbox: runc over an overlay of the layers)"
$dsec run demo@1 -- hello
echo
echo "== a detached sandbox keeps its state between execs"
id=$($dsec run -d demo@1)
$dsec exec "$id" -- sh -c 'echo "state kept" > /srv/www/note.txt'
$dsec exec "$id" -- cat /srv/www/note.txt
printf '1\n2\n39\n' | $dsec exec "$id" -- sum-lines
$dsec ps
$dsec rm "$id"
