#!/bin/busybox sh
# PID 1 of a dsec microvm/vm guest. Kernel command line keys (dsec.*):
#   dsec.root=erofs|ext4   filesystem of the read-only root image on the first disk
#   dsec.hostname=NAME     dsec.net=1 (configure eth0 for QEMU user-mode networking)
#   dsec.pids=N            at most N processes for the agent and everything it starts
# Disks, in order: the shared read-only root image, then the sandbox's writable disk.
# Everything the guest changes lands in <writable disk>/upper in overlayfs upper format.
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "dsec-init: $*" > /dev/ttyS0; sync; poweroff -f; }

mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
exec 2>/dev/ttyS0

root_fs=erofs hostname=sandbox net=0 pids=
for kv in $(cat /proc/cmdline); do
  case "$kv" in
    dsec.root=*) root_fs=${kv#*=} ;;
    dsec.hostname=*) hostname=${kv#*=} ;;
    dsec.net=*) net=${kv#*=} ;;
    dsec.pids=*) pids=${kv#*=} ;;
  esac
done

while read -r m; do
  [ -n "$m" ] && insmod "/lib/modules/$m" 2>/dev/null
done < /lib/modules/load-order

# Devices appear asynchronously after their drivers load.
i=0
while [ ! -b /dev/vdb ] || [ -z "$(ls /sys/class/virtio-ports 2>/dev/null)" ]; do
  i=$((i + 1)); [ "$i" -gt 500 ] && fail "disks or agent port did not appear"
  sleep 0.02
done

mount -t "$root_fs" -o ro /dev/vda /mnt/lower || fail "cannot mount root image"
mount -t ext4 /dev/vdb /mnt/disk || fail "cannot mount writable disk"
mkdir -p /mnt/disk/upper /mnt/disk/work
# index/redirect_dir/metacopy off keep the upper dir plain: what a layer diff expects.
mount -t overlay overlay \
  -o lowerdir=/mnt/lower,upperdir=/mnt/disk/upper,workdir=/mnt/disk/work,index=off,redirect_dir=off,metacopy=off,xino=off \
  /newroot || fail "cannot mount overlay"

# The root image was built with these mount points, so mounting adds nothing to upper/.
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm

hostname "$hostname"
ip link set lo up 2>/dev/null
if [ "$net" = 1 ] && [ -e /sys/class/net/eth0 ]; then
  # QEMU user-mode networking: fixed addresses, no DHCP round trip.
  ip link set eth0 up
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
  if [ -f /newroot/etc/resolv.conf ]; then
    echo "nameserver 10.0.2.3" > /etc/resolv.conf
    mount --bind /etc/resolv.conf /newroot/etc/resolv.conf
  fi
fi

if [ -n "$pids" ]; then
  # a pids cgroup around the agent: its execs inherit it, the init's own mounts do not matter
  mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "cannot mount cgroup2"
  echo +pids > /sys/fs/cgroup/cgroup.subtree_control
  mkdir /sys/fs/cgroup/sandbox
  echo "$pids" > /sys/fs/cgroup/sandbox/pids.max
  echo $$ > /sys/fs/cgroup/sandbox/cgroup.procs || fail "cannot apply the pids limit"
fi

port=
for p in /sys/class/virtio-ports/*; do
  [ "$(cat "$p/name" 2>/dev/null)" = dsec.agent ] && port=/dev/${p##*/}
done
[ -n "$port" ] || fail "no dsec.agent virtio-serial port"
echo "dsec-init: root mounted at $(cut -d" " -f1 /proc/uptime)s, agent on $port" > /dev/ttyS0

# The agent runs chrooted in the sandbox root but from the initramfs copy (through
# /proc/self/fd), so the sandbox tree never holds it.
exec 3< /bin/dsec-agent
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  chroot /newroot /proc/self/fd/3 --serial "$port"
