/*
 * dsec-agent: the exec server that runs inside every dsec sandbox (usually as its init).
 *
 * It serves one framed, multiplexed request/response protocol (docs/agent.md) over byte
 * streams: accepted unix-socket connections (containers), an inherited fd (stdio), or a
 * character device such as a virtio-serial port (VMs). Several execs may be in flight on one
 * stream, told apart by request ids. As pid 1 it also reaps every orphaned process.
 *
 * Built static (`gcc -static -O2`) so it runs in any image, even one without a libc.
 *
 * usage: dsec-agent (--listen PATH | --listen-fd N | --fd N | --serial PATH) [--ready-fd N]
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <grp.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/random.h>

#define PROTO_VERSION 1
#define MAX_FRAME (16u << 20)
#define MAX_CONN 128
#define MAX_EXEC 1024
#define IO_CHUNK 65536

/* client -> agent */
enum { T_EXEC = 1, T_STDIN = 2, T_PUT = 3, T_GET = 4, T_PING = 5, T_SIGNAL = 6, T_TREE = 7,
       T_IDENTITY = 8, T_PUT_AS = 9, T_GET_AS = 10 };
/* agent -> client */
enum { T_STDOUT = 16, T_STDERR = 17, T_EXIT = 18, T_RESULT = 19, T_DATA = 20 };

#define EXEC_F_STDIN 1u  /* stdin comes in T_STDIN frames; otherwise /dev/null */
#define EXEC_F_USER 2u   /* u32 uid, gid, ngroups, groups[] follow the env: run as that user */
#define MAX_GROUPS 65536
#define PUT_F_APPEND 1u  /* append to the file instead of creating/truncating it */
#define PUT_F_AT 2u      /* u64 offset follows the path: write the data there (no create) */
#define PUT_F_SIZE 4u    /* u64 size follows the path: set the file's size (no create) */
#define TREE_CHUNK (1u << 20)
#define TREE_DEPTH 256

struct conn {
    int fd;               /* -1: slot free */
    int reopen;           /* a serial device: reopen on EOF instead of giving up */
    uint8_t *buf;
    size_t len, cap;
};

struct ex {
    int used;
    int conn;             /* -1 once the client went away: reap silently */
    uint32_t id;
    pid_t pid;
    int out, err, in;     /* -1 when closed */
    uint8_t *inbuf;
    size_t inlen;
    int in_eof;
    int64_t deadline;     /* monotonic ms, 0 = none */
    int timed_out;
};

static struct conn conns[MAX_CONN];
static struct ex execs[MAX_EXEC];
static int listen_fd = -1;
static int sig_pipe[2];
static volatile sig_atomic_t terminate;
static const char *serial_path;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put32(uint8_t *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static uint32_t get32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void set_nonblock(int fd, int on) {
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

static void close_conn(int ci);

/* Frames to one connection are written whole and in order; a slow client only slows itself
 * and the agent, never corrupts the stream. */
static int send_frame(int ci, uint8_t type, uint32_t id, const void *a, size_t alen,
                      const void *b, size_t blen) {
    if (ci < 0 || conns[ci].fd < 0) return -1;
    uint8_t hdr[9];
    put32(hdr, (uint32_t)(5 + alen + blen));
    hdr[4] = type;
    put32(hdr + 5, id);
    const void *parts[3] = {hdr, a, b};
    size_t lens[3] = {9, alen, blen};
    for (int i = 0; i < 3; i++) {
        const uint8_t *p = parts[i];
        size_t n = lens[i];
        while (n > 0) {
            ssize_t w = write(conns[ci].fd, p, n);
            if (w < 0 && errno == EINTR) continue;
            if (w < 0 && errno == EAGAIN) {
                struct pollfd pf = {conns[ci].fd, POLLOUT, 0};
                poll(&pf, 1, 1000);
                continue;
            }
            if (w <= 0) { close_conn(ci); return -1; }
            p += w; n -= (size_t)w;
        }
    }
    return 0;
}

static void send_result(int ci, uint32_t id, int32_t err, const char *msg) {
    uint8_t code[4];
    put32(code, (uint32_t)err);
    send_frame(ci, T_RESULT, id, code, 4, msg, msg ? strlen(msg) : 0);
}

static void send_errno(int ci, uint32_t id, const char *what, const char *path) {
    char msg[4200];
    int e = errno;
    snprintf(msg, sizeof msg, "%s %s: %s", what, path, strerror(e));
    send_result(ci, id, e ? e : EIO, msg);
}

static void kill_exec(struct ex *x, int sig) {
    if (x->pid > 0) {
        /* the exec leads its own process group; repeat so children forked while the
         * first signal was being delivered (a fork bomb) are caught too */
        for (int i = 0; i < (sig == SIGKILL ? 3 : 1); i++) kill(-x->pid, sig);
        kill(x->pid, sig);
    }
}

static void close_conn(int ci) {
    if (conns[ci].fd < 0) return;
    close(conns[ci].fd);
    conns[ci].fd = -1;
    free(conns[ci].buf);
    conns[ci].buf = NULL;
    conns[ci].len = conns[ci].cap = 0;
    for (int i = 0; i < MAX_EXEC; i++) {
        if (execs[i].used && execs[i].conn == ci) {
            kill_exec(&execs[i], SIGKILL);
            execs[i].conn = -1;
        }
    }
}

static struct ex *find_exec(int ci, uint32_t id) {
    for (int i = 0; i < MAX_EXEC; i++)
        if (execs[i].used && execs[i].conn == ci && execs[i].id == id) return &execs[i];
    return NULL;
}

static void close_fd(int *fd) {
    if (*fd >= 0) { close(*fd); *fd = -1; }
}

/* Read what a pipe holds now; forward it. Returns 0 on EOF or error (pipe closed). */
static int pump(struct ex *x, int *fd, uint8_t type) {
    static uint8_t buf[IO_CHUNK];
    for (;;) {
        ssize_t r = read(*fd, buf, sizeof buf);
        if (r > 0) {
            send_frame(x->conn, type, x->id, buf, (size_t)r, NULL, 0);
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EAGAIN) return 1;
        close_fd(fd);
        return 0;
    }
}

static void flush_stdin(struct ex *x) {
    while (x->in >= 0 && x->inlen > 0) {
        ssize_t w = write(x->in, x->inbuf, x->inlen);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) return;
        if (w <= 0) { close_fd(&x->in); x->inlen = 0; return; }
        memmove(x->inbuf, x->inbuf + w, x->inlen - (size_t)w);
        x->inlen -= (size_t)w;
    }
    if (x->in >= 0 && x->in_eof && x->inlen == 0) close_fd(&x->in);
}

static void finish_exec(struct ex *x, int status) {
    /* The process is gone, so everything it wrote is already in the pipes: drain them, then
     * stop listening (a background grandchild holding the pipe must not stall the reply). */
    if (x->out >= 0) pump(x, &x->out, T_STDOUT);
    if (x->err >= 0) pump(x, &x->err, T_STDERR);
    close_fd(&x->out);
    close_fd(&x->err);
    close_fd(&x->in);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    uint8_t p[8];
    put32(p, (uint32_t)code);
    put32(p + 4, x->timed_out ? 1u : 0u);
    if (x->conn >= 0) send_frame(x->conn, T_EXIT, x->id, p, 8, NULL, 0);
    free(x->inbuf);
    memset(x, 0, sizeof *x);
    x->out = x->err = x->in = -1;
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_EXEC; i++) {
            if (execs[i].used && execs[i].pid == pid) {
                finish_exec(&execs[i], status);
                break;
            }
        }
        /* any other pid was an orphan re-parented to us as init: reaping it is the job */
    }
}

/* --- request decoding ------------------------------------------------------------------- */

struct rd { const uint8_t *p; size_t n; int bad; };

static uint32_t rd32(struct rd *r) {
    if (r->n < 4) { r->bad = 1; return 0; }
    uint32_t v = get32(r->p);
    r->p += 4; r->n -= 4;
    return v;
}

static uint64_t rd64(struct rd *r) {
    uint64_t hi = rd32(r);
    return (hi << 32) | rd32(r);
}

static void put64(uint8_t *p, uint64_t v) {
    put32(p, (uint32_t)(v >> 32));
    put32(p + 4, (uint32_t)v);
}

static const char *kind_name(mode_t m) {
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISLNK(m)) return "a symlink";
    return "not a regular file";
}

static char *rdstr(struct rd *r) {
    uint32_t len = rd32(r);
    if (r->bad || len > r->n) { r->bad = 1; return NULL; }
    char *s = malloc(len + 1);
    if (!s) { r->bad = 1; return NULL; }
    memcpy(s, r->p, len);
    s[len] = 0;
    r->p += len; r->n -= len;
    return s;
}

static void do_exec(int ci, uint32_t id, const uint8_t *p, size_t n) {
    struct rd r = {p, n, 0};
    uint32_t flags = rd32(&r), timeout_ms = rd32(&r), argc = rd32(&r), envc = rd32(&r);
    if (r.bad || argc == 0 || argc > 65536 || envc > 65536) {
        send_result(ci, id, EINVAL, "malformed exec request");
        return;
    }
    if (find_exec(ci, id)) { send_result(ci, id, EEXIST, "request id already in use"); return; }
    struct ex *x = NULL;
    for (int i = 0; i < MAX_EXEC; i++) if (!execs[i].used) { x = &execs[i]; break; }
    if (!x) { send_result(ci, id, EAGAIN, "too many execs in flight"); return; }

    char *cwd = rdstr(&r);
    char **argv = calloc(argc + 1, sizeof *argv);
    char **env = calloc(envc + 1, sizeof *env);
    for (uint32_t i = 0; i < argc && !r.bad; i++) argv[i] = rdstr(&r);
    for (uint32_t i = 0; i < envc && !r.bad; i++) env[i] = rdstr(&r);
    uint32_t uid = 0, gid = 0, ngroups = 0;
    gid_t *groups = NULL;
    if ((flags & EXEC_F_USER) && !r.bad) {
        uid = rd32(&r); gid = rd32(&r); ngroups = rd32(&r);
        if (ngroups > MAX_GROUPS) r.bad = 1;
        else {
            groups = calloc(ngroups + 1, sizeof *groups);
            for (uint32_t i = 0; i < ngroups && !r.bad; i++) groups[i] = rd32(&r);
        }
    }
    int po[2] = {-1, -1}, pe[2] = {-1, -1}, pi[2] = {-1, -1};
    if (r.bad) {
        send_result(ci, id, EINVAL, "malformed exec request");
        goto out;
    }
    if (pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC) ||
        ((flags & EXEC_F_STDIN) && pipe2(pi, O_CLOEXEC))) {
        send_errno(ci, id, "pipe", "");
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) {
        send_errno(ci, id, "fork", argv[0]);
        goto out;
    }
    if (pid == 0) {
        setsid();
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        /* the OOM killer must pick what the agent starts, never the agent: as init, its
         * death ends the sandbox. Commands score 300 above the agent (whose own score the
         * host sets by the sandbox's class). Raising a score needs no privilege. */
        int oom = open("/proc/self/oom_score_adj", O_RDONLY | O_CLOEXEC);
        int adj = 0;
        if (oom >= 0) {
            char cur[16];
            ssize_t got = read(oom, cur, sizeof cur - 1);
            if (got > 0) {
                cur[got] = 0;
                adj = atoi(cur);
            }
            close(oom);
        }
        adj = adj + 300 > 1000 ? 1000 : adj + 300;
        oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) {
            char val[16];
            int len = snprintf(val, sizeof val, "%d", adj);
            ssize_t ow = write(oom, val, (size_t)len);
            (void)ow;
            close(oom);
        }
        int in = (flags & EXEC_F_STDIN) ? pi[0] : open("/dev/null", O_RDONLY);
        dup2(in, 0);
        dup2(po[1], 1);
        dup2(pe[1], 2);
        for (uint32_t i = 0; i < envc; i++) putenv(env[i]);
        /* groups first, then gid, then uid: after setuid the right to change them is gone */
        if ((flags & EXEC_F_USER) && (setgroups(ngroups, groups) != 0 || setgid(gid) != 0 ||
                                      setuid(uid) != 0)) {
            dprintf(2, "dsec-agent: cannot switch to user %u:%u: %s\n", uid, gid, strerror(errno));
            _exit(126);
        }
        if (cwd && *cwd && chdir(cwd) != 0) {
            dprintf(2, "dsec-agent: cannot enter working directory %s: %s\n", cwd, strerror(errno));
            _exit(126);
        }
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "dsec-agent: cannot execute %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    memset(x, 0, sizeof *x);
    x->used = 1;
    x->conn = ci;
    x->id = id;
    x->pid = pid;
    x->out = po[0];
    x->err = pe[0];
    x->in = (flags & EXEC_F_STDIN) ? pi[1] : -1;
    x->deadline = timeout_ms ? now_ms() + timeout_ms : 0;
    close(po[1]); close(pe[1]);
    if (pi[0] >= 0) close(pi[0]);
    set_nonblock(x->out, 1);
    set_nonblock(x->err, 1);
    if (x->in >= 0) set_nonblock(x->in, 1);
    po[0] = po[1] = pe[0] = pe[1] = pi[0] = pi[1] = -1;
out:
    for (int i = 0; i < 2; i++) {
        if (po[i] >= 0) close(po[i]);
        if (pe[i] >= 0) close(pe[i]);
        if (pi[i] >= 0) close(pi[i]);
    }
    free(cwd);
    for (uint32_t i = 0; i < argc; i++) free(argv[i]);
    for (uint32_t i = 0; i < envc; i++) free(env[i]);
    free(argv);
    free(env);
    free(groups);
}

static void do_stdin(int ci, uint32_t id, const uint8_t *p, size_t n) {
    struct ex *x = find_exec(ci, id);
    if (!x || x->in < 0) return;  /* the process already closed its stdin: drop, like a pipe */
    if (n == 0) {
        x->in_eof = 1;
    } else {
        uint8_t *nb = realloc(x->inbuf, x->inlen + n);
        if (!nb) return;
        x->inbuf = nb;
        memcpy(x->inbuf + x->inlen, p, n);
        x->inlen += n;
    }
    flush_stdin(x);
}

static int mkparents(char *path) {
    for (char *s = path + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        int rc = mkdir(path, 0755);
        *s = '/';
        if (rc != 0 && errno != EEXIST) return -1;
    }
    return 0;
}

static void do_put(int ci, uint32_t id, const uint8_t *p, size_t n) {
    struct rd r = {p, n, 0};
    uint32_t mode = rd32(&r), flags = rd32(&r);
    char *path = rdstr(&r);
    uint64_t at = (flags & (PUT_F_AT | PUT_F_SIZE)) ? rd64(&r) : 0;
    if (r.bad || !path || !*path || at > (uint64_t)INT64_MAX) {
        send_result(ci, id, EINVAL, "malformed put request");
        free(path);
        return;
    }
    int fd = -1;
    int create = !(flags & (PUT_F_APPEND | PUT_F_AT | PUT_F_SIZE));
    if (create && mkparents(path) != 0) {
        send_errno(ci, id, "mkdir parents of", path);
        goto out;
    }
    /* O_NONBLOCK: a FIFO planted at the path must not wedge the agent in open() */
    fd = open(path, O_WRONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY |
                    (create ? O_CREAT | O_TRUNC : 0) | ((flags & PUT_F_APPEND) ? O_APPEND : 0),
              mode & 07777);
    if (fd < 0) { send_errno(ci, id, "open", path); goto out; }
    struct stat st;
    if (fstat(fd, &st) != 0) { send_errno(ci, id, "stat", path); goto out; }
    if (!S_ISREG(st.st_mode)) {
        char msg[4200];
        snprintf(msg, sizeof msg, "%s is %s: only regular files can be written", path,
                 kind_name(st.st_mode));
        send_result(ci, id, EINVAL, msg);
        goto out;
    }
    if (create) fchmod(fd, mode & 07777);
    if ((flags & PUT_F_SIZE) && ftruncate(fd, (off_t)at) != 0) {
        send_errno(ci, id, "truncate", path);
        goto out;
    }
    off_t pos = (off_t)at;
    while (r.n > 0) {
        ssize_t w = (flags & PUT_F_AT) ? pwrite(fd, r.p, r.n, pos) : write(fd, r.p, r.n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { send_errno(ci, id, "write", path); goto out; }
        r.p += w; r.n -= (size_t)w; pos += w;
    }
    send_result(ci, id, 0, NULL);
out:
    if (fd >= 0) close(fd);
    free(path);
}

static void do_get(int ci, uint32_t id, const uint8_t *p, size_t n) {
    char *path = malloc(n + 1);
    memcpy(path, p, n);
    path[n] = 0;
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    struct stat st;
    if (fd < 0) { send_errno(ci, id, "open", path); goto out; }
    if (fstat(fd, &st) != 0) { send_errno(ci, id, "stat", path); goto out; }
    if (!S_ISREG(st.st_mode)) {
        char msg[4200];
        snprintf(msg, sizeof msg, "%s is %s: only regular files can be read", path,
                 kind_name(st.st_mode));
        send_result(ci, id, S_ISDIR(st.st_mode) ? EISDIR : EINVAL, msg);
        goto out;
    }
    uint8_t mode[4];
    put32(mode, st.st_mode & 07777);
    static uint8_t buf[1 << 20];
    send_frame(ci, T_DATA, id, mode, 4, NULL, 0);  /* first DATA frame: the file mode */
    for (;;) {
        ssize_t rr = read(fd, buf, sizeof buf);
        if (rr < 0 && errno == EINTR) continue;
        if (rr < 0) { send_errno(ci, id, "read", path); goto out; }
        if (rr == 0) break;
        if (send_frame(ci, T_DATA, id, buf, (size_t)rr, NULL, 0) != 0) goto out;
    }
    send_result(ci, id, 0, NULL);
out:
    if (fd >= 0) close(fd);
    free(path);
}

/* --- PUT_AS / GET_AS: a file request made with a user's credentials -----------------------
 * The payload is `u32 uid, u32 gid, u32 ngroups, ngroups x u32 gid` and then a PUT or GET
 * payload. The agent is one thread, so it takes the user's file-system ids (setfsuid,
 * setfsgid: as the user, the kernel's permission checks apply and what is created is the
 * user's) and supplementary groups for the one request, and takes its own back before the
 * next: no fork, and nothing else runs meanwhile. */

static gid_t own_groups[MAX_GROUPS];
static int own_ngroups = -1;
static int groups_taken;  /* setgroups succeeded: the agent's own must be put back */

static int become(uid_t uid, gid_t gid, uint32_t ngroups, const gid_t *groups) {
    if (own_ngroups < 0) {
        own_ngroups = getgroups(MAX_GROUPS, own_groups);
        if (own_ngroups < 0) return -1;
    }
    if (setgroups(ngroups, groups) != 0) return -1;
    groups_taken = 1;
    /* setfsuid and setfsgid answer the previous id whatever happens: ask again to know */
    setfsgid(gid);
    setfsuid(uid);
    if ((uid_t)setfsuid((uid_t)-1) != uid || (gid_t)setfsgid((gid_t)-1) != gid) {
        errno = EPERM;
        return -1;
    }
    return 0;
}

static void unbecome(void) {
    setfsuid(geteuid());
    setfsgid(getegid());
    if (!groups_taken) return;
    groups_taken = 0;
    if (setgroups((size_t)own_ngroups, own_groups) != 0) {
        /* the agent cannot take its own groups back: stopping is safer than serving on */
        perror("dsec-agent: setgroups");
        _exit(1);
    }
}

static void do_as(int ci, uint32_t id, const uint8_t *p, size_t n, int put) {
    struct rd r = {p, n, 0};
    uint32_t uid = rd32(&r), gid = rd32(&r), ngroups = rd32(&r);
    if (r.bad || ngroups > MAX_GROUPS || r.n / 4 < ngroups || uid == (uint32_t)-1 ||
        gid == (uint32_t)-1) {
        send_result(ci, id, EINVAL, "malformed user file request");
        return;
    }
    gid_t *groups = calloc(ngroups + 1, sizeof *groups);
    if (!groups) { send_result(ci, id, ENOMEM, "out of memory"); return; }
    for (uint32_t i = 0; i < ngroups; i++) groups[i] = rd32(&r);
    if (become(uid, gid, ngroups, groups) != 0) {
        char msg[128];
        int e = errno;
        snprintf(msg, sizeof msg, "cannot act as user %u:%u: %s", uid, gid, strerror(e));
        unbecome();
        send_result(ci, id, e ? e : EPERM, msg);
    } else {
        if (put) do_put(ci, id, r.p, r.n);
        else do_get(ci, id, r.p, r.n);
        unbecome();
    }
    free(groups);
}

/* --- TREE: copy a file, symlink or directory out, streamed ------------------------------
 * DATA records: 'E' kind mode size relpath target (one per entry, parents first) and
 * 'C' offset bytes (file content; gaps between chunks are holes). Symlinks are sent as
 * symlinks, never followed; anything but regular files, directories and symlinks ends the
 * copy with EINVAL naming the path and its type, without being opened for reading. */

static uint8_t tree_buf[9 + TREE_CHUNK];

struct tree { int ci; uint32_t id; const char *top; };

static int tree_fail(struct tree *t, int err, const char *rel, const char *what) {
    char msg[8400];
    size_t tl = strlen(t->top);
    int slash = *rel && !(tl > 0 && t->top[tl - 1] == '/');
    snprintf(msg, sizeof msg, "%s%s%s: %s", t->top, slash ? "/" : "", rel, what);
    send_result(t->ci, t->id, err ? err : EIO, msg);
    return -1;
}

static int tree_entry(struct tree *t, char kind, mode_t mode, uint64_t size, const char *rel,
                      const char *target) {
    size_t rl = strlen(rel), tl = strlen(target);
    uint8_t *b = malloc(22 + rl + tl);
    if (!b) return tree_fail(t, ENOMEM, rel, "out of memory");
    b[0] = 'E';
    b[1] = (uint8_t)kind;
    put32(b + 2, (uint32_t)(mode & 07777));
    put64(b + 6, size);
    put32(b + 14, (uint32_t)rl);
    memcpy(b + 18, rel, rl);
    put32(b + 18 + rl, (uint32_t)tl);
    memcpy(b + 22 + rl, target, tl);
    int rc = send_frame(t->ci, T_DATA, t->id, b, 22 + rl + tl, NULL, 0);
    free(b);
    return rc;
}

/* Only the data extents are read and sent (SEEK_DATA/SEEK_HOLE), so a sparse file's holes
 * cost nothing; reads stop at the size taken when the file was opened. */
static int tree_file(struct tree *t, int fd, uint64_t size, const char *rel) {
    off_t off = 0;
    while ((uint64_t)off < size) {
        off_t data = lseek(fd, off, SEEK_DATA);
        if (data < 0 && errno == ENXIO) return 0;
        if (data < 0) data = off;  /* no SEEK_DATA here: everything is data */
        if ((uint64_t)data >= size) return 0;
        off_t hole = lseek(fd, data, SEEK_HOLE);
        if (hole < 0 || (uint64_t)hole > size) hole = (off_t)size;
        for (off_t p = data; p < hole;) {
            size_t want = (size_t)(hole - p) < TREE_CHUNK ? (size_t)(hole - p) : TREE_CHUNK;
            ssize_t r = pread(fd, tree_buf + 9, want, p);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) return tree_fail(t, errno, rel, strerror(errno));
            if (r == 0) return 0;  /* shrank while read: the rest stays a hole */
            tree_buf[0] = 'C';
            put64(tree_buf + 1, (uint64_t)p);
            if (send_frame(t->ci, T_DATA, t->id, tree_buf, 9 + (size_t)r, NULL, 0) != 0) return -1;
            p += r;
        }
        off = hole;
    }
    return 0;
}

static int tree_walk(struct tree *t, int at, const char *name, char *rel, int depth) {
    struct stat st;
    if (fstatat(at, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return tree_fail(t, errno, rel, strerror(errno));
    if (S_ISLNK(st.st_mode)) {
        char target[4097];
        ssize_t n = readlinkat(at, name, target, sizeof target - 1);
        if (n < 0) return tree_fail(t, errno, rel, strerror(errno));
        target[n] = 0;
        return tree_entry(t, 'l', 0777, 0, rel, target);
    }
    if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        char what[128];
        snprintf(what, sizeof what, "is %s: only regular files, directories and symlinks "
                 "can be copied", kind_name(st.st_mode));
        return tree_fail(t, EINVAL, rel, what);
    }
    int fd = openat(at, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY |
                    (S_ISDIR(st.st_mode) ? O_DIRECTORY : 0));
    if (fd < 0) return tree_fail(t, errno, rel, strerror(errno));
    /* what was opened is what counts: the entry may have been swapped since the fstatat */
    if (fstat(fd, &st) != 0 || (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))) {
        close(fd);
        return tree_fail(t, EINVAL, rel, "changed type while being copied");
    }
    if (S_ISREG(st.st_mode)) {
        int rc = tree_entry(t, 'f', st.st_mode, (uint64_t)st.st_size, rel, "");
        if (rc == 0) rc = tree_file(t, fd, (uint64_t)st.st_size, rel);
        close(fd);
        return rc;
    }
    if (depth >= TREE_DEPTH) { close(fd); return tree_fail(t, ELOOP, rel, "nested too deep"); }
    if (tree_entry(t, 'd', st.st_mode, 0, rel, "") != 0) { close(fd); return -1; }
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); return tree_fail(t, errno, rel, strerror(errno)); }
    size_t rl = strlen(rel);
    struct dirent *de;
    int rc = 0;
    while (rc == 0 && (errno = 0, de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        size_t nl = strlen(de->d_name);
        if (rl + nl + 2 > 4096) { rc = tree_fail(t, ENAMETOOLONG, rel, "path too long"); break; }
        if (rl) rel[rl] = '/';
        memcpy(rel + rl + (rl ? 1 : 0), de->d_name, nl + 1);
        rc = tree_walk(t, dirfd(d), de->d_name, rel, depth + 1);
        rel[rl] = 0;
    }
    if (rc == 0 && errno != 0) rc = tree_fail(t, errno, rel, strerror(errno));
    closedir(d);
    return rc;
}

static void do_tree(int ci, uint32_t id, const uint8_t *p, size_t n) {
    char *path = malloc(n + 1);
    if (!path) { send_result(ci, id, ENOMEM, "out of memory"); return; }
    memcpy(path, p, n);
    path[n] = 0;
    if (!*path || strlen(path) != n) {
        send_result(ci, id, EINVAL, "malformed tree request");
        free(path);
        return;
    }
    struct tree t = {ci, id, path};
    char rel[4096] = "";
    if (tree_walk(&t, AT_FDCWD, path, rel, 0) == 0) send_result(ci, id, 0, NULL);
    free(path);
}

/* A VM restored from a snapshot takes its own identity in its first request, in the agent
 * itself (a fork and exec in a guest fresh from its snapshot costs tens of ms under TCG):
 *     u32 hostname length, hostname, u32 machine-id length, machine id, host random bytes
 * The bytes are mixed into the kernel's entropy pool and credited, and the CRNG reseeded at
 * once (RNDADDENTROPY, RNDRESEEDCRNG), so no two VMs restored from one snapshot share random
 * numbers; the hostname is set; /etc/machine-id is rewritten where the image has one. */
static void do_identity(int ci, uint32_t id, const uint8_t *p, size_t n) {
    static struct { int entropy_count; int buf_size; unsigned char buf[512]; } pool;
    char host[65], mid[65];
    if (n < 4) goto bad;
    uint32_t hl = get32(p);
    if (hl > 64 || n < 8 + (size_t)hl) goto bad;
    memcpy(host, p + 4, hl);
    host[hl] = 0;
    uint32_t ml = get32(p + 4 + hl);
    if (ml > 64 || n < 8 + (size_t)hl + ml) goto bad;
    memcpy(mid, p + 8 + hl, ml);
    mid[ml] = 0;
    size_t rl = n - 8 - hl - ml;
    if (rl < 32 || rl > sizeof pool.buf || strlen(host) != hl || strlen(mid) != ml) goto bad;
    memcpy(pool.buf, p + 8 + hl + ml, rl);
    pool.buf_size = (int)rl;
    pool.entropy_count = (int)rl * 8;
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0) { send_errno(ci, id, "open", "/dev/urandom"); return; }
    int rc = ioctl(fd, RNDADDENTROPY, &pool);
    if (rc == 0) rc = ioctl(fd, RNDRESEEDCRNG, 0);
    int e = errno;
    close(fd);
    memset(pool.buf, 0, sizeof pool.buf);
    if (rc != 0) { errno = e; send_errno(ci, id, "reseeding the CRNG through", "/dev/urandom"); return; }
    if (hl && sethostname(host, hl) != 0) { send_errno(ci, id, "sethostname", host); return; }
    if (ml) {
        int m = open("/etc/machine-id", O_WRONLY | O_TRUNC | O_CLOEXEC);  /* never created */
        if (m >= 0) {
            mid[ml] = '\n';
            ssize_t w = write(m, mid, ml + 1);
            e = errno;
            close(m);
            if (w != (ssize_t)ml + 1) { errno = w < 0 ? e : EIO; send_errno(ci, id, "write", "/etc/machine-id"); return; }
        } else if (errno != ENOENT) { send_errno(ci, id, "open", "/etc/machine-id"); return; }
    }
    send_result(ci, id, 0, NULL);
    return;
bad:
    send_result(ci, id, EINVAL, "malformed identity request");
}

static void handle_frame(int ci, uint8_t type, uint32_t id, const uint8_t *p, size_t n) {
    switch (type) {
    case T_EXEC: do_exec(ci, id, p, n); break;
    case T_STDIN: do_stdin(ci, id, p, n); break;
    case T_PUT: do_put(ci, id, p, n); break;
    case T_GET: do_get(ci, id, p, n); break;
    case T_PUT_AS: do_as(ci, id, p, n, 1); break;
    case T_GET_AS: do_as(ci, id, p, n, 0); break;
    case T_TREE: do_tree(ci, id, p, n); break;
    case T_IDENTITY: do_identity(ci, id, p, n); break;
    case T_PING: {
        char msg[64];
        snprintf(msg, sizeof msg, "dsec-agent %d pid %d", PROTO_VERSION, (int)getpid());
        send_result(ci, id, 0, msg);
        break;
    }
    case T_SIGNAL: {
        struct ex *x = find_exec(ci, id);
        if (x && n >= 4) kill_exec(x, (int)get32(p));
        break;
    }
    default: send_result(ci, id, ENOSYS, "unknown request type");
    }
}

static int open_serial(void) {
    int fd = open(serial_path, O_RDWR | O_CLOEXEC | O_NOCTTY);
    return fd;
}

static void read_conn(int ci) {
    struct conn *c = &conns[ci];
    if (c->cap - c->len < IO_CHUNK) {
        size_t cap = c->cap ? c->cap * 2 : 4 * IO_CHUNK;
        while (cap - c->len < IO_CHUNK) cap *= 2;
        uint8_t *nb = realloc(c->buf, cap);
        if (!nb) { close_conn(ci); return; }
        c->buf = nb;
        c->cap = cap;
    }
    ssize_t r = read(c->fd, c->buf + c->len, c->cap - c->len);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (r <= 0) {
        int reopen = c->reopen;
        close_conn(ci);
        if (reopen) {  /* the host side of a serial port went away: wait for the next one */
            usleep(50000);
            int fd = open_serial();
            if (fd >= 0) { conns[ci].fd = fd; conns[ci].reopen = 1; }
        }
        return;
    }
    c->len += (size_t)r;
    size_t off = 0;
    while (c->len - off >= 9) {
        uint32_t flen = get32(c->buf + off);
        if (flen < 5 || flen > MAX_FRAME) { close_conn(ci); return; }
        if (c->len - off < 4 + (size_t)flen) break;
        uint8_t type = c->buf[off + 4];
        uint32_t id = get32(c->buf + off + 5);
        handle_frame(ci, type, id, c->buf + off + 9, flen - 5);
        if (conns[ci].fd < 0) return;  /* closed while handling */
        off += 4 + (size_t)flen;
    }
    memmove(c->buf, c->buf + off, c->len - off);
    c->len -= off;
}

static int add_conn(int fd, int reopen) {
    for (int i = 0; i < MAX_CONN; i++) {
        if (conns[i].fd < 0) {
            conns[i].fd = fd;
            conns[i].reopen = reopen;
            return i;
        }
    }
    close(fd);
    return -1;
}

static void on_signal(int sig) {
    if (sig == SIGTERM || sig == SIGINT) terminate = 1;
    int e = errno;
    ssize_t w = write(sig_pipe[1], "x", 1);
    (void)w;
    errno = e;
}

static void usage(void) {
    fprintf(stderr, "usage: dsec-agent (--listen PATH | --listen-fd N | --fd N | --serial PATH) "
            "[--ready-fd N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *listen_path = NULL;
    int serve_fd = -1, ready_fd = -1, bound_fd = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--listen") && i + 1 < argc) listen_path = argv[++i];
        else if (!strcmp(argv[i], "--listen-fd") && i + 1 < argc) bound_fd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--fd") && i + 1 < argc) serve_fd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--serial") && i + 1 < argc) serial_path = argv[++i];
        else if (!strcmp(argv[i], "--ready-fd") && i + 1 < argc) ready_fd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--version")) { printf("dsec-agent %d\n", PROTO_VERSION); return 0; }
        else usage();
    }
    if (!listen_path && bound_fd < 0 && serve_fd < 0 && !serial_path) usage();
    for (int i = 0; i < MAX_CONN; i++) conns[i].fd = -1;
    for (int i = 0; i < MAX_EXEC; i++) execs[i].out = execs[i].err = execs[i].in = -1;

    if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) { perror("pipe"); return 1; }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    if (listen_path) {
        struct sockaddr_un addr;
        memset(&addr, 0, sizeof addr);
        addr.sun_family = AF_UNIX;
        if (strlen(listen_path) >= sizeof addr.sun_path) { fprintf(stderr, "socket path too long\n"); return 1; }
        strcpy(addr.sun_path, listen_path);
        unlink(listen_path);
        listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (listen_fd < 0 || bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
            listen(listen_fd, 128) != 0) {
            perror("dsec-agent: listen");
            return 1;
        }
        set_nonblock(listen_fd, 1);
    }
    if (bound_fd >= 0) {
        /* a socket the host bound in a directory the sandbox cannot see: listening here
         * makes this process the peer the host's SO_PEERCRED check sees */
        fcntl(bound_fd, F_SETFD, FD_CLOEXEC);
        if (listen(bound_fd, 128) != 0) { perror("dsec-agent: listen"); return 1; }
        listen_fd = bound_fd;
        set_nonblock(listen_fd, 1);
    }
    if (serve_fd >= 0) {
        fcntl(serve_fd, F_SETFD, FD_CLOEXEC);
        add_conn(serve_fd, 0);
    }
    if (serial_path) {
        int fd = open_serial();
        if (fd < 0) { perror("dsec-agent: open serial"); return 1; }
        add_conn(fd, 1);
    }
    if (ready_fd >= 0) {
        ssize_t w = write(ready_fd, "R", 1);
        (void)w;
        close(ready_fd);
    }

    static struct pollfd pfds[2 + MAX_CONN + 3 * MAX_EXEC];
    static int kind[2 + MAX_CONN + 3 * MAX_EXEC], idx[2 + MAX_CONN + 3 * MAX_EXEC];
    while (!terminate) {
        if (listen_fd < 0 && !serial_path) {  /* --fd mode: done once the stream is gone */
            int open_conns = 0;
            for (int i = 0; i < MAX_CONN; i++) open_conns += conns[i].fd >= 0;
            if (!open_conns) break;
        }
        int n = 0;
        int64_t next = 0;
        pfds[n] = (struct pollfd){sig_pipe[0], POLLIN, 0}; kind[n++] = 0;
        if (listen_fd >= 0) { pfds[n] = (struct pollfd){listen_fd, POLLIN, 0}; kind[n++] = 1; }
        for (int i = 0; i < MAX_CONN; i++)
            if (conns[i].fd >= 0) { pfds[n] = (struct pollfd){conns[i].fd, POLLIN, 0}; kind[n] = 2; idx[n++] = i; }
        for (int i = 0; i < MAX_EXEC; i++) {
            struct ex *x = &execs[i];
            if (!x->used) continue;
            if (x->out >= 0) { pfds[n] = (struct pollfd){x->out, POLLIN, 0}; kind[n] = 3; idx[n++] = i; }
            if (x->err >= 0) { pfds[n] = (struct pollfd){x->err, POLLIN, 0}; kind[n] = 4; idx[n++] = i; }
            if (x->in >= 0 && x->inlen > 0) { pfds[n] = (struct pollfd){x->in, POLLOUT, 0}; kind[n] = 5; idx[n++] = i; }
            if (x->deadline && !x->timed_out && (!next || x->deadline < next)) next = x->deadline;
        }
        int timeout = -1;
        if (next) {
            int64_t d = next - now_ms();
            timeout = d < 0 ? 0 : (int)d;
        }
        int rc = poll(pfds, (nfds_t)n, timeout);
        if (rc < 0 && errno != EINTR) { perror("poll"); return 1; }
        int64_t t = now_ms();
        for (int i = 0; i < MAX_EXEC; i++) {
            struct ex *x = &execs[i];
            if (x->used && x->deadline && !x->timed_out && t >= x->deadline) {
                x->timed_out = 1;
                kill_exec(x, SIGKILL);
            }
        }
        if (rc <= 0) { if (rc == 0 || errno == EINTR) reap(); continue; }
        for (int k = 0; k < n; k++) {
            if (!pfds[k].revents) continue;
            switch (kind[k]) {
            case 0: {
                char b[256];
                while (read(sig_pipe[0], b, sizeof b) > 0) {}
                break;
            }
            case 1: {
                int fd;
                while ((fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC)) >= 0) add_conn(fd, 0);
                break;
            }
            case 2:
                if (conns[idx[k]].fd == pfds[k].fd) read_conn(idx[k]);
                break;
            case 3:
                if (execs[idx[k]].used && execs[idx[k]].out == pfds[k].fd)
                    pump(&execs[idx[k]], &execs[idx[k]].out, T_STDOUT);
                break;
            case 4:
                if (execs[idx[k]].used && execs[idx[k]].err == pfds[k].fd)
                    pump(&execs[idx[k]], &execs[idx[k]].err, T_STDERR);
                break;
            case 5:
                if (execs[idx[k]].used && execs[idx[k]].in == pfds[k].fd) flush_stdin(&execs[idx[k]]);
                break;
            }
        }
        reap();
    }
    for (int i = 0; i < MAX_EXEC; i++) if (execs[i].used) kill_exec(&execs[i], SIGKILL);
    return 0;
}
