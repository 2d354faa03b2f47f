/* A probe for the sandbox walls, run inside sandboxes by tests/security/test_walls.py.
 *
 *   wallprobe euid       print the effective uid (setuid copies of it show whether the
 *                        host honours the setuid bit)
 *   wallprobe syscalls   call each system call the seccomp policy denies, with arguments
 *                        that change nothing outside this process even where a call is
 *                        allowed and privileged (mounts name a filesystem type that does not
 *                        exist and a target that does not exist), and print "name errno"
 *                        (0: the call succeeded)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void report(const char *name, long rc) {
    printf("%s %d\n", name, rc < 0 ? errno : 0);
}

/* run fn in a child: the policy kills a process for a foreign ABI */
static void in_child(const char *name, void (*fn)(void)) {
    pid_t pid = fork();
    if (pid == 0) {
        fn();
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    printf("%s %s\n", name, WIFSIGNALED(st) && WTERMSIG(st) == SIGSYS ? "killed" : "ran");
}

static void x32_getpid(void) { syscall(0x40000000 | 39); }

static void i386_getpid(void) {
    long rc;
    __asm__ volatile("int $0x80" : "=a"(rc) : "a"(20) : "memory");
    (void)rc;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "euid") == 0) {
        printf("%d\n", (int)geteuid());
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "syscalls") != 0) {
        fprintf(stderr, "usage: wallprobe euid|syscalls\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    report("keyctl", syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -1 /* thread */, 0));
    report("add_key", syscall(SYS_add_key, "wallprobe-notype", "wallprobe", "x", 1, -1));
    report("bpf", syscall(SYS_bpf, 0, NULL, 0));
    report("perf_event_open", syscall(SYS_perf_event_open, NULL, 0, -1, -1, 0));
    report("userfaultfd", syscall(SYS_userfaultfd, 1 /* UFFD_USER_MODE_ONLY */));
    report("io_uring_setup", syscall(SYS_io_uring_setup, 1, NULL));
    report("name_to_handle_at", syscall(SYS_name_to_handle_at, AT_FDCWD, "/", NULL, NULL, 0));
    report("open_by_handle_at", syscall(SYS_open_by_handle_at, -1, NULL, 0));
    report("mount", syscall(SYS_mount, "none", "/wallprobe-nonexistent", "wallprobe-nofs",
                            1 /* MS_RDONLY */, NULL));
    report("fsopen", syscall(SYS_fsopen, "wallprobe-nofs", 0));
    report("open_tree", syscall(SYS_open_tree, AT_FDCWD, "/", 0));
    report("setns", syscall(SYS_setns, -1, 0));
    report("unshare_user", syscall(SYS_unshare, CLONE_NEWUSER));
    report("unshare_mount", syscall(SYS_unshare, CLONE_NEWNS));
    report("personality_no_aslr", syscall(SYS_personality, 0x0040000 /* ADDR_NO_RANDOMIZE */));
    report("clone3", syscall(SYS_clone3, NULL, 0));
    long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0)
        _exit(0);
    if (pid > 0)
        waitpid((pid_t)pid, NULL, 0);
    report("clone_newuser", pid);
    /* allowed: plain fork, and a harmless personality query of the default */
    pid = syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (pid == 0)
        _exit(0);
    if (pid > 0)
        waitpid((pid_t)pid, NULL, 0);
    report("clone_plain", pid);
    report("personality_linux", syscall(SYS_personality, 0));
    in_child("x32", x32_getpid);
    in_child("i386", i386_getpid);
    return 0;
}
