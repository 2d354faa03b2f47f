"""The QEMU backends (`microvm`, `vm`) and their parts: the backend (qemu.py), the KVM-or-TCG
probe (qemu_accel.py), a QMP client (qemu_qmp.py), the guest kernel and initramfs
(vmkernel.py), the root image and per-sandbox disks (vmimage.py), and the guest init scripts
(guest/)."""
