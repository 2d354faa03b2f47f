"""The sandbox seccomp policy: one list of denied system calls, rendered two ways.

* `oci_profile()`: the `linux.seccomp` section of a runc spec (the container backend); runc
  compiles it with libseccomp.
* `bpf_program()`: a classic-BPF program for `bwrap --seccomp FD` (fncall, the function pool
  and build `run` steps), assembled here so no compiler or libseccomp tooling is needed.

The policy is a deny list with a default of allow. It blocks at least what Docker's default
profile blocks for a container without CAP_SYS_ADMIN: kernel modules, kexec, reboot, swap,
every mount call (old and new API), bpf, perf events, the keyring, file handles, userfaultfd,
clock and time setting, syslog, quotas, io_uring, NUMA policy calls, setns and unshare,
namespace flags on clone (clone3 answers ENOSYS so libc falls back to clone, whose flags a
classic filter can read), and personality flags that weaken ASLR or make data executable.
The BPF program also kills a process that makes a system call through another ABI (i386,
x32), where the syscall numbers differ and a deny list by number would not hold.

User namespaces are denied (CLONE_NEWUSER through clone, unshare): inside one, a root process
gets every capability again and reaches kernel code (netfilter, mount, filesystems) that
container escapes have historically come through; an RL action has no need for them.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Any

#: x86-64 numbers of the denied calls (from asm/unistd_64.h)
DENIED: dict[str, int] = {
    # kernel modules, kexec, reboot, swap, accounting
    "init_module": 175, "finit_module": 313, "delete_module": 176, "create_module": 174,
    "get_kernel_syms": 177, "query_module": 178, "kexec_load": 246, "kexec_file_load": 320,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
    # mounts, old and new API, and file handles (open_by_handle_at escaped early Docker)
    "mount": 165, "umount2": 166, "pivot_root": 155, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428, "open_tree_attr": 467,
    "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304,
    # namespaces: joining another or making new ones (clone's flags are checked apart)
    "setns": 308, "unshare": 272,
    # kernel attack surface without a use in a sandbox
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248,
    "request_key": 249, "lookup_dcookie": 212, "fanotify_init": 300, "kcmp": 312,
    # host time, logs, quotas, I/O ports, ttys
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "syslog": 103, "quotactl": 179, "quotactl_fd": 443, "iopl": 172, "ioperm": 173,
    "vhangup": 153,
    # NUMA placement (CAP_SYS_NICE in Docker's profile)
    "mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "migrate_pages": 256,
    "move_pages": 279,
    # obsolete calls
    "uselib": 134, "ustat": 136, "sysfs": 139, "_sysctl": 156, "nfsservctl": 180,
    "afs_syscall": 183, "tuxcall": 184, "security": 185, "vserver": 236, "getpmsg": 181,
    "putpmsg": 182,
}
NR_CLONE, NR_CLONE3, NR_PERSONALITY = 56, 435, 135

#: CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                  0x40000000)
#: READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT: the bits the
#: kernel itself clears on a setuid exec (PER_CLEAR_ON_SETID)
PERSONALITY_UNSAFE = (0x0400000, 0x0040000, 0x0100000, 0x0200000)

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000


def oci_profile() -> dict[str, Any]:
    """The policy as an OCI runtime spec `linux.seccomp` object."""
    masked = [{"index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}
              for f in CLONE_NS_FLAGS]
    pers = [{"index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}
            for f in PERSONALITY_UNSAFE]
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        # only the native ABI: libseccomp answers calls of other ABIs (i386, x32) with the
        # kill action it uses for a foreign architecture
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [
            {"names": sorted(DENIED), **eperm},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
            # libseccomp ORs rules of one call: one rule per flag is "any flag set"
            *({"names": ["clone"], **eperm, "args": [a]} for a in masked),
            *({"names": ["personality"], **eperm, "args": [a]} for a in pers),
        ],
    }


# -- classic BPF ---------------------------------------------------------------------------------
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16  # struct seccomp_data, little-endian


def bpf_program() -> bytes:
    """The policy as an array of `struct sock_filter` (what bwrap --seccomp reads)."""
    # (code, jump-if-true label, jump-if-false label, k); None means "next instruction"
    prog: list[tuple[int, str | None, str | None, int]] = []
    labels: dict[str, int] = {}

    def op(code: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        prog.append((code, jt, jf, k))

    def label(name: str) -> None:
        labels[name] = len(prog)

    op(_LD_W_ABS, _OFF_ARCH)
    op(_JEQ, AUDIT_ARCH_X86_64, None, "kill")
    op(_LD_W_ABS, _OFF_NR)
    op(_JGE, X32_SYSCALL_BIT, "kill", None)
    for nr in sorted(DENIED.values()):
        op(_JEQ, nr, "deny", None)
    op(_JEQ, NR_CLONE, "clone", None)
    op(_JEQ, NR_CLONE3, "enosys", None)
    op(_JEQ, NR_PERSONALITY, "personality", None)
    op(_RET, _RET_ALLOW)
    label("clone")
    op(_LD_W_ABS, _OFF_ARG0_LO)  # clone takes its flags from the low 32 bits
    mask = 0
    for f in CLONE_NS_FLAGS:
        mask |= f
    op(_JSET, mask, "deny", "allow")
    label("personality")
    op(_LD_W_ABS, _OFF_ARG0_LO)  # personality's argument is an unsigned int
    unsafe = 0
    for f in PERSONALITY_UNSAFE:
        unsafe |= f
    op(_JSET, unsafe, "deny", "allow")
    label("allow")
    op(_RET, _RET_ALLOW)
    label("deny")
    op(_RET, _RET_ERRNO | errno.EPERM)
    label("enosys")
    op(_RET, _RET_ERRNO | errno.ENOSYS)
    label("kill")
    op(_RET, _RET_KILL_PROCESS)

    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offs = []
        for target in (jt, jf):
            off = 0 if target is None else labels[target] - (i + 1)
            if not 0 <= off <= 255:
                raise AssertionError(f"seccomp jump out of range at {i}")  # a bug here, not input
            offs.append(off)
        out += struct.pack("<HBBI", code, offs[0], offs[1], k)
    return bytes(out)


def bpf_fd() -> int:
    """A readable fd holding the BPF program, for `bwrap --seccomp FD` (caller closes it)."""
    fd = os.memfd_create("dsec-seccomp", os.MFD_CLOEXEC)
    os.write(fd, _PROGRAM)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


_PROGRAM = bpf_program()
