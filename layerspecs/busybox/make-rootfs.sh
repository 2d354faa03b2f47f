#!/usr/bin/env bash
# Makes busybox-rootfs.tar beside this script: a minimal root filesystem from Debian's
# busybox-static (the binary, one symlink per applet, /etc basics). Deterministic: sorted
# entries, numeric root ownership, and every mtime set to the busybox binary's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/busybox-rootfs.tar"
bb=/bin/busybox
[ -x "$bb" ] || { echo "busybox-static is not installed (apt-get install busybox-static)" >&2; exit 1; }
[ -f "$out" ] && [ "$out" -nt "$bb" ] && [ "$out" -nt "$0" ] && exit 0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
r="$tmp/root"
mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,etc,root,tmp,var/tmp,proc,sys,dev,home}
cp "$bb" "$r/bin/busybox"
for app in $("$bb" --list-full); do
  [ "$app" = bin/busybox ] && continue
  mkdir -p "$r/$(dirname "$app")"
  rel=$(realpath -m --relative-to="$r/$(dirname "$app")" "$r/bin/busybox")
  ln -sf "$rel" "$r/$app"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$r/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$r/etc/group"
printf 'Welcome to a dsec sandbox.\n' > "$r/etc/motd"
printf 'dsec\n' > "$r/etc/hostname"
chmod 1777 "$r/tmp" "$r/var/tmp"; chmod 700 "$r/root"
stamp=$(date -u -r "$bb" +%Y-%m-%dT%H:%M:%SZ)
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="$stamp" --format=pax \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$r" -cf "$out.tmp" .
mv "$out.tmp" "$out"
