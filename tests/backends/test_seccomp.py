"""The seccomp policy's two renderings agree with its one list: the BPF program, run by a
small classic-BPF interpreter here, answers every call as the list says, and the numbers in
the list are the kernel headers' numbers."""

from __future__ import annotations

import errno
import re
import struct
from pathlib import Path

import pytest

from dsec_cli.backends import seccomp

HEADER = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
ALLOW, KILL = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS


def run_bpf(prog: bytes, nr: int, arch: int = seccomp.AUDIT_ARCH_X86_64, arg0: int = 0) -> int:
    """Evaluate a classic-BPF seccomp program on one struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        elif code == 0x15:  # jeq
            pc += jt if acc == k else jf
        elif code == 0x35:  # jge
            pc += jt if acc >= k else jf
        elif code == 0x45:  # jset
            pc += jt if acc & k else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def test_bpf_program_follows_the_list() -> None:
    prog = seccomp.bpf_program()
    for name, nr in seccomp.DENIED.items():
        assert run_bpf(prog, nr) == EPERM, name
    denied = set(seccomp.DENIED.values()) | {seccomp.NR_CLONE3}
    for nr in range(0, 470):
        if nr not in denied:
            assert run_bpf(prog, nr) == ALLOW, nr
    assert run_bpf(prog, seccomp.NR_CLONE3) == ENOSYS
    for flag in seccomp.CLONE_NS_FLAGS:
        assert run_bpf(prog, seccomp.NR_CLONE, arg0=flag | 17) == EPERM, hex(flag)
    assert run_bpf(prog, seccomp.NR_CLONE, arg0=0x01200011) == ALLOW  # what fork() passes
    assert run_bpf(prog, seccomp.NR_PERSONALITY, arg0=0x0040000) == EPERM  # no ASLR
    assert run_bpf(prog, seccomp.NR_PERSONALITY, arg0=0x0008) == ALLOW  # PER_LINUX32
    assert run_bpf(prog, 39, arch=0x40000003) == KILL  # i386
    assert run_bpf(prog, 0x40000000 | 39) == KILL  # x32


def test_oci_profile_follows_the_list() -> None:
    prof = seccomp.oci_profile()
    assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
    first = prof["syscalls"][0]
    assert set(first["names"]) == set(seccomp.DENIED) and first["errnoRet"] == errno.EPERM
    clone_flags = {r["args"][0]["value"] for r in prof["syscalls"] if r["names"] == ["clone"]}
    assert clone_flags == set(seccomp.CLONE_NS_FLAGS)


@pytest.mark.skipif(not HEADER.exists(), reason="kernel headers (linux-libc-dev) not installed")
def test_numbers_match_kernel_headers() -> None:
    nums = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", HEADER.read_text())}
    named = {**seccomp.DENIED, "clone": seccomp.NR_CLONE, "clone3": seccomp.NR_CLONE3,
             "personality": seccomp.NR_PERSONALITY}
    wrong = {k: (v, nums[k]) for k, v in named.items() if k in nums and nums[k] != v}
    assert wrong == {}
    # every name is checked, bar calls newer than Debian 12's headers (a misspelt name fails)
    assert set(named) - set(nums) <= {"open_tree_attr"}
