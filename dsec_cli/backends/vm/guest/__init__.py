"""Files that run inside microvm/vm guests: the init scripts packed into the initramfs.

`init.sh` mounts the sandbox root (read-only image + writable disk under overlayfs) and
starts the exec agent on the `dsec.agent` virtio-serial port; `poweroff.sh` is the
smallest useful guest (boot, power off) used by the acceleration probe and benchmarks.
"""
