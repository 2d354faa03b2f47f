/*
 * dsec-identity: gives a VM restored from a snapshot its own identity. The snapshot holds it;
 * the host runs it through the agent as the restored guest's first request:
 *     dsec-identity HOSTNAME MACHINE-ID [OTHER-COPY...]  < host random bytes
 * It sets the hostname, mixes the bytes into the kernel's entropy pool, credits them and
 * makes the kernel reseed its CRNG at once (RNDADDENTROPY, RNDRESEEDCRNG), so no two VMs
 * restored from one snapshot share random numbers, and rewrites /etc/machine-id when the
 * image has one, and removes itself and any OTHER-COPY (the snapshot's copy, when a copy was
 * sent again because the first request got no answer). No libc: a few raw syscalls, so it is a
 * few KB to send into the guest.
 */
#include <linux/random.h>

static long sc(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}

enum { SYS_read = 0, SYS_write = 1, SYS_open = 2, SYS_close = 3, SYS_ioctl = 16,
       SYS_exit = 60, SYS_unlink = 87, SYS_sethostname = 170 };

static unsigned long len(const char *s) { unsigned long n = 0; while (s[n]) n++; return n; }

struct pool { int entropy_count; int buf_size; unsigned char buf[256]; };

__asm__(".globl _start\n_start:\n mov %rsp, %rdi\n and $-16, %rsp\n call start_c\n hlt\n");

void start_c(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    int bad = 0;
    static struct pool p;
    long got = 0;
    while (got < (long)sizeof p.buf) {
        long n = sc(SYS_read, 0, (long)(p.buf + got), sizeof p.buf - got);
        if (n <= 0) break;
        got += n;
    }
    if (got < 32) bad |= 1;
    int fd = (int)sc(SYS_open, (long)"/dev/urandom", 01 /* O_WRONLY */, 0);
    if (fd < 0) bad |= 2;
    else {
        p.entropy_count = (int)got * 8;
        p.buf_size = (int)got;
        if (sc(SYS_ioctl, fd, RNDADDENTROPY, (long)&p) < 0) bad |= 4;
        if (sc(SYS_ioctl, fd, RNDRESEEDCRNG, 0) < 0) bad |= 8;
        sc(SYS_close, fd, 0, 0);
    }
    if (argc > 1 && sc(SYS_sethostname, (long)argv[1], len(argv[1]), 0) < 0) bad |= 16;
    if (argc > 2) {  /* a fresh machine id, only where the image has one */
        int m = (int)sc(SYS_open, (long)"/etc/machine-id", 01 | 01000 /* O_WRONLY|O_TRUNC */, 0);
        if (m >= 0) {
            sc(SYS_write, m, (long)argv[2], len(argv[2]));
            sc(SYS_write, m, (long)"\n", 1);
            sc(SYS_close, m, 0, 0);
        }
    }
    sc(SYS_unlink, (long)argv[0], 0, 0);
    for (long i = 3; i < argc; i++) sc(SYS_unlink, (long)argv[i], 0, 0);
    sc(SYS_exit, bad, 0, 0);
}
