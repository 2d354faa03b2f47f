#!/bin/busybox sh
# The floor guest: the kernel reached userspace, power off at once.
/bin/busybox echo dsec-guest-up > /dev/ttyS0 2>/dev/null
/bin/busybox poweroff -f
