/* The compiled request loop of kernel-served lazy mounts (kernelfs.py).
 *
 * Loop(fd, inodes, budget) reads requests from /dev/fuse with the GIL released and answers
 * those whose answer is already in its per-inode table, filled by Python as it learns them:
 * OPEN (open flags and backing id), READ of a file whose verified bytes were handed over,
 * READLINK (a link's data is its target), OPENDIR, READDIRPLUS and LOOKUP of a directory
 * whose listing and names were handed over,
 * GETATTR (a prebuilt fuse_attr_out), RELEASE/RELEASEDIR/FLUSH (empty replies) and
 * FORGET/BATCH_FORGET/INTERRUPT (no reply). Any other request is returned to the caller as
 * bytes and answered by the Python code. Several threads may call next() at once: the kernel
 * hands each request to one reader, and each reply is one writev.
 *
 * Table entries are only ever added (bytes objects are kept until the loop is freed), so a
 * reader copies an entry's fields under the mutex and writes its reply without holding it.
 * Every length taken from a request is checked against what was read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { OP_LOOKUP = 1, OP_FORGET = 2, OP_GETATTR = 3, OP_READLINK = 5, OP_OPEN = 14, OP_READ = 15,
       OP_RELEASE = 18, OP_FLUSH = 25, OP_OPENDIR = 27, OP_RELEASEDIR = 29,
       OP_INTERRUPT = 36, OP_BATCH_FORGET = 42, OP_READDIRPLUS = 44 };
#define IN_HEADER 40
#define OUT_HEADER 16
#define ATTR_OUT 104 /* fuse_attr_out: valid, valid_nsec, dummy, fuse_attr */
#define ENTRY_OUT 128 /* fuse_entry_out */
#define REQUEST_BUFFER (64 << 10)

typedef struct {
    const char *data; /* inline bytes (owned by obj), or NULL */
    Py_ssize_t len;
    PyObject *obj;
    unsigned char *attr; /* ATTR_OUT bytes, or NULL */
    PyObject *list_obj;  /* a directory's whole READDIRPLUS listing (bytes), or NULL */
    uint32_t *list_off;  /* where record i starts in it; list_off[list_n] its length */
    uint32_t list_n;
    int32_t backing;
    uint32_t open_flags;
    uint8_t has_open, notify, opened, named; /* named: every child name is in the names */
} Entry;

/* One name of a directory whose children were handed over: its LOOKUP answer. */
typedef struct {
    uint64_t parent;
    char *name; /* NULL: a free slot */
    size_t len;
    unsigned char entry[ENTRY_OUT];
} Name;

typedef struct {
    PyObject_HEAD
    int fd;
    uint64_t inodes;
    Entry *tab;
    pthread_mutex_t mu;
    Py_ssize_t budget, held;
    double record_until; /* CLOCK_MONOTONIC seconds: first opens answered here are logged */
    Name *names;
    size_t names_cap, names_n;
    unsigned char negative[ENTRY_OUT];
    uint64_t *log_ino;
    double *log_t;
    size_t log_n, log_cap;
    uint64_t answered, bytes_served, handed;
    uint64_t by_op[64]; /* requests answered here, by opcode */
    uint64_t handed_by_op[64]; /* requests handed to Python, by opcode */
} Loop;

static double now_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int Loop_init(Loop *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "inodes", "budget", NULL};
    unsigned long long inodes;
    Py_ssize_t budget;
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iKn", names, &fd, &inodes, &budget))
        return -1;
    if (self->tab != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Loop initialised twice");
        return -1;
    }
    if (inodes == 0 || inodes > (1ULL << 32)) {
        PyErr_SetString(PyExc_ValueError, "inodes out of range");
        return -1;
    }
    /* its own descriptor of the connection, closed only when no reader can be using it:
     * the caller closing its own can never make a reader read or write another file */
    self->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (self->fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->tab = calloc(inodes, sizeof(Entry));
    if (self->tab == NULL) {
        close(self->fd);
        PyErr_NoMemory();
        return -1;
    }
    self->inodes = inodes;
    self->budget = budget;
    uint64_t day = 86400; /* a negative entry, cached as long as a positive one */
    memcpy(self->negative + 16, &day, 8);
    memcpy(self->negative + 24, &day, 8);
    pthread_mutex_init(&self->mu, NULL);
    return 0;
}

static void Loop_dealloc(Loop *self) {
    if (self->tab != NULL) {
        for (uint64_t i = 0; i < self->inodes; i++) {
            Py_XDECREF(self->tab[i].obj);
            free(self->tab[i].attr);
            Py_XDECREF(self->tab[i].list_obj);
            free(self->tab[i].list_off);
        }
        for (size_t i = 0; i < self->names_cap; i++)
            free(self->names[i].name);
        free(self->names);
        free(self->tab);
        pthread_mutex_destroy(&self->mu);
        close(self->fd);
    }
    free(self->log_ino);
    free(self->log_t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Entry *entry_of(Loop *self, unsigned long long ino) {
    if (self->tab == NULL || ino >= self->inodes) {
        PyErr_SetString(PyExc_ValueError, "inode out of range");
        return NULL;
    }
    return &self->tab[ino];
}

static PyObject *Loop_set_open(Loop *self, PyObject *args) {
    unsigned long long ino;
    unsigned int flags;
    int backing;
    if (!PyArg_ParseTuple(args, "KIi", &ino, &flags, &backing))
        return NULL;
    Entry *e = entry_of(self, ino);
    if (e == NULL)
        return NULL;
    pthread_mutex_lock(&self->mu);
    e->open_flags = flags;
    e->backing = backing;
    e->has_open = 1;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Loop_set_data(Loop *self, PyObject *args) {
    unsigned long long ino;
    PyObject *data;
    int notify;
    Py_ssize_t off = 0, len = -1, cost = -1;
    if (!PyArg_ParseTuple(args, "KSp|nnn", &ino, &data, &notify, &off, &len, &cost))
        return NULL;
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    if (len < 0)
        len = size - off;
    if (off < 0 || off > size || len < 0 || len > size - off) {
        PyErr_SetString(PyExc_ValueError, "offset and length must lie within data");
        return NULL;
    }
    if (cost < 0)
        cost = len;
    Entry *e = entry_of(self, ino);
    if (e == NULL)
        return NULL;
    int taken = 0;
    pthread_mutex_lock(&self->mu);
    if (e->obj == NULL && self->held + cost <= self->budget) {
        Py_INCREF(data);
        e->obj = data;
        e->len = len;
        e->data = PyBytes_AS_STRING(data) + off;
        e->notify = (uint8_t)notify;
        self->held += cost;
        taken = 1;
    }
    pthread_mutex_unlock(&self->mu);
    return PyBool_FromLong(taken);
}

static PyObject *Loop_has_data(Loop *self, PyObject *args) {
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    Entry *e = entry_of(self, ino);
    if (e == NULL)
        return NULL;
    pthread_mutex_lock(&self->mu);
    int has = e->obj != NULL;
    pthread_mutex_unlock(&self->mu);
    return PyBool_FromLong(has);
}

static PyObject *Loop_set_notify(Loop *self, PyObject *args) {
    unsigned long long ino;
    int notify;
    if (!PyArg_ParseTuple(args, "Kp", &ino, &notify))
        return NULL;
    Entry *e = entry_of(self, ino);
    if (e == NULL)
        return NULL;
    pthread_mutex_lock(&self->mu);
    e->notify = (uint8_t)notify;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Loop_set_attr(Loop *self, PyObject *args) {
    unsigned long long ino;
    const char *attr;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Ky#", &ino, &attr, &len))
        return NULL;
    if (len != ATTR_OUT) {
        PyErr_SetString(PyExc_ValueError, "attr_out must be 104 bytes");
        return NULL;
    }
    Entry *e = entry_of(self, ino);
    if (e == NULL)
        return NULL;
    unsigned char *copy = malloc(ATTR_OUT);
    if (copy == NULL)
        return PyErr_NoMemory();
    memcpy(copy, attr, ATTR_OUT);
    pthread_mutex_lock(&self->mu);
    if (e->attr == NULL) { /* set once: a reader may be copying the first one */
        e->attr = copy;
        copy = NULL;
    }
    pthread_mutex_unlock(&self->mu);
    free(copy);
    Py_RETURN_NONE;
}

static uint64_t name_hash(uint64_t parent, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL ^ parent; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    return h;
}

/* The slot of (parent, name), or the free slot where it goes (under mu). */
static Name *name_slot(Loop *self, uint64_t parent, const char *name, size_t len) {
    size_t mask = self->names_cap - 1;
    for (size_t i = name_hash(parent, name, len) & mask;; i = (i + 1) & mask) {
        Name *n = &self->names[i];
        if (n->name == NULL || (n->parent == parent && n->len == len &&
                                memcmp(n->name, name, len) == 0))
            return n;
    }
}

static int names_grow(Loop *self) {
    size_t cap = self->names_cap ? self->names_cap * 2 : 1024;
    Name *old = self->names, *tab = calloc(cap, sizeof(Name));
    if (tab == NULL)
        return -1;
    size_t oldcap = self->names_cap;
    self->names = tab;
    self->names_cap = cap;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i].name != NULL)
            *name_slot(self, old[i].parent, old[i].name, old[i].len) = old[i];
    free(old);
    return 0;
}

static PyObject *Loop_set_names(Loop *self, PyObject *args) {
    unsigned long long parent;
    PyObject *items;
    if (!PyArg_ParseTuple(args, "KO!", &parent, &PyList_Type, &items))
        return NULL;
    Entry *e = entry_of(self, parent);
    if (e == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(it, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(it, 1)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(it, 1)) != ENTRY_OUT) {
            PyErr_SetString(PyExc_ValueError, "names: [(name, 128-byte entry_out)]");
            return NULL;
        }
    }
    pthread_mutex_lock(&self->mu);
    int failed = 0;
    if (!e->named) {
        for (Py_ssize_t i = 0; i < n && !failed; i++) {
            PyObject *it = PyList_GET_ITEM(items, i);
            const char *name = PyBytes_AS_STRING(PyTuple_GET_ITEM(it, 0));
            size_t len = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(it, 0));
            if ((self->names_n + 1) * 2 > self->names_cap && names_grow(self) < 0) {
                failed = 1;
                break;
            }
            Name *slot = name_slot(self, parent, name, len);
            if (slot->name == NULL) {
                slot->name = malloc(len ? len : 1);
                if (slot->name == NULL) {
                    failed = 1;
                    break;
                }
                memcpy(slot->name, name, len);
                slot->len = len;
                slot->parent = parent;
                self->names_n++;
            }
            memcpy(slot->entry, PyBytes_AS_STRING(PyTuple_GET_ITEM(it, 1)), ENTRY_OUT);
        }
        e->named = !failed; /* from now on a name not in the table is no child of parent */
    }
    pthread_mutex_unlock(&self->mu);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Loop_set_listing(Loop *self, PyObject *args) {
    unsigned long long ino;
    PyObject *blob, *starts;
    if (!PyArg_ParseTuple(args, "KSO!", &ino, &blob, &PyList_Type, &starts))
        return NULL;
    Entry *e = entry_of(self, ino);
    if (e == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(starts);
    uint32_t *off = malloc((size_t)(n + 1) * sizeof(uint32_t));
    if (off == NULL)
        return PyErr_NoMemory();
    uint32_t prev = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(starts, i));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v < prev ||
            v > (unsigned long)PyBytes_GET_SIZE(blob)) {
            free(off);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "record starts must rise within the listing");
            return NULL;
        }
        off[i] = prev = (uint32_t)v;
    }
    if (PyBytes_GET_SIZE(blob) > UINT32_MAX) {
        free(off);
        PyErr_SetString(PyExc_ValueError, "listing too large");
        return NULL;
    }
    off[n] = (uint32_t)PyBytes_GET_SIZE(blob);
    pthread_mutex_lock(&self->mu);
    if (e->list_obj == NULL) {
        Py_INCREF(blob);
        e->list_obj = blob;
        e->list_off = off;
        e->list_n = (uint32_t)n;
        off = NULL;
    }
    pthread_mutex_unlock(&self->mu);
    free(off);
    Py_RETURN_NONE;
}

static PyObject *Loop_record_until(Loop *self, PyObject *arg) {
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    pthread_mutex_lock(&self->mu);
    self->record_until = t;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Loop_opens(Loop *self, PyObject *unused) {
    pthread_mutex_lock(&self->mu);
    size_t n = self->log_n;
    uint64_t *inos = self->log_ino;
    double *ts = self->log_t;
    self->log_ino = NULL;
    self->log_t = NULL;
    self->log_n = self->log_cap = 0;
    pthread_mutex_unlock(&self->mu);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(Kd)", (unsigned long long)inos[i], ts[i]);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    free(inos);
    free(ts);
    return out;
}

static PyObject *op_counts(uint64_t *counts) {
    PyObject *ops = PyDict_New();
    for (int i = 0; ops != NULL && i < 64; i++) {
        uint64_t v = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
        if (v == 0)
            continue;
        PyObject *k = PyLong_FromLong(i), *n = PyLong_FromUnsignedLongLong(v);
        if (k == NULL || n == NULL || PyDict_SetItem(ops, k, n) < 0)
            Py_CLEAR(ops);
        Py_XDECREF(k);
        Py_XDECREF(n);
    }
    return ops;
}

static PyObject *Loop_counters(Loop *self, PyObject *unused) {
    PyObject *ops = op_counts(self->by_op);
    if (ops == NULL)
        return NULL;
    PyObject *handed = op_counts(self->handed_by_op);
    if (handed == NULL) {
        Py_DECREF(ops);
        return NULL;
    }
    return Py_BuildValue("{sKsKsKsnsNsN}",
                         "answered", (unsigned long long)__atomic_load_n(&self->answered, __ATOMIC_RELAXED),
                         "bytes_served", (unsigned long long)__atomic_load_n(&self->bytes_served, __ATOMIC_RELAXED),
                         "handed", (unsigned long long)__atomic_load_n(&self->handed, __ATOMIC_RELAXED),
                         "inline_bytes", self->held, "by_op", ops, "handed_by_op", handed);
}

/* One reply; 0, or an errno other than the request having gone meanwhile. */
static int reply(int fd, uint64_t unique, const void *data, size_t len) {
    unsigned char hdr[OUT_HEADER];
    uint32_t total = (uint32_t)(OUT_HEADER + len);
    int32_t err = 0;
    memcpy(hdr, &total, 4);
    memcpy(hdr + 4, &err, 4);
    memcpy(hdr + 8, &unique, 8);
    struct iovec iov[2] = {{hdr, OUT_HEADER}, {(void *)data, len}};
    if (writev(fd, iov, len ? 2 : 1) < 0 && errno != ENOENT && errno != ENODEV)
        return errno;
    return 0;
}

/* Log a first open answered here while the access profile records (under mu). */
static void log_open(Loop *self, Entry *e, uint64_t ino) {
    if (e->opened)
        return;
    e->opened = 1;
    double t = now_mono();
    if (t > self->record_until)
        return;
    if (self->log_n == self->log_cap) {
        size_t cap = self->log_cap ? self->log_cap * 2 : 256;
        uint64_t *a = realloc(self->log_ino, cap * sizeof(uint64_t));
        if (a == NULL)
            return;
        self->log_ino = a;
        double *b = realloc(self->log_t, cap * sizeof(double));
        if (b == NULL)
            return;
        self->log_t = b;
        self->log_cap = cap;
    }
    self->log_ino[self->log_n] = ino;
    self->log_t[self->log_n++] = t;
}

/* What `answer` returns once a reply went out (err: its errno, 0 if sent): 2 when Python
 * asked to hear of this inode's request (*notify set), else 1. */
static int sent(int err, int wants, uint64_t ino, uint64_t *notify) {
    if (err)
        return -err;
    if (wants) {
        *notify = ino;
        return 2;
    }
    return 1;
}

/* Answer the request in buf (n bytes) if the table knows how: 1 answered, 2 answered and
 * Python asked to hear of it (*notify set), 0 not answerable here, -errno on a write error. */
static int answer(Loop *self, const unsigned char *buf, size_t n, uint64_t *notify) {
    uint32_t len, op;
    uint64_t unique, ino;
    memcpy(&len, buf, 4);
    memcpy(&op, buf + 4, 4);
    memcpy(&unique, buf + 8, 8);
    memcpy(&ino, buf + 16, 8);
    if (len < n)
        n = len;
    if (n < IN_HEADER)
        return 0;
    const unsigned char *body = buf + IN_HEADER;
    size_t blen = n - IN_HEADER;
    int err;
    switch (op) {
    case OP_FORGET:
    case OP_BATCH_FORGET:
    case OP_INTERRUPT:
        return 1; /* no reply: inodes live as long as the mount */
    case OP_RELEASE:
    case OP_RELEASEDIR:
    case OP_FLUSH:
        err = reply(self->fd, unique, NULL, 0);
        return sent(err, 0, ino, notify);
    default:
        break;
    }
    if (ino >= self->inodes)
        return 0;
    Entry *e = &self->tab[ino];
    if (op == OP_OPEN || op == OP_OPENDIR) { /* an inode is either a file or a directory */
        unsigned char out[16] = {0};
        pthread_mutex_lock(&self->mu);
        int known = e->has_open;
        if (known) {
            memcpy(out + 8, &e->open_flags, 4);
            memcpy(out + 12, &e->backing, 4);
            if (op == OP_OPEN)
                log_open(self, e, ino);
        }
        pthread_mutex_unlock(&self->mu);
        if (!known)
            return 0;
        err = reply(self->fd, unique, out, sizeof out);
        return sent(err, 0, ino, notify);
    }
    /* READ and READDIRPLUS: fuse_read_in's offset and size */
    uint64_t off = 0;
    uint32_t size = 0;
    if (op == OP_READ || op == OP_READDIRPLUS) {
        if (blen < 24)
            return 0;
        memcpy(&off, body + 8, 8);
        memcpy(&size, body + 16, 4);
    }
    if (op == OP_READ) {
        pthread_mutex_lock(&self->mu);
        const char *data = e->data;
        Py_ssize_t dlen = e->len;
        int wants = data != NULL && e->notify;
        if (wants)
            e->notify = 0;
        pthread_mutex_unlock(&self->mu);
        if (data == NULL)
            return 0;
        size_t start = off < (uint64_t)dlen ? (size_t)off : (size_t)dlen;
        size_t count = (size_t)dlen - start < size ? (size_t)dlen - start : size;
        err = reply(self->fd, unique, data + start, count);
        if (!err)
            __atomic_fetch_add(&self->bytes_served, count, __ATOMIC_RELAXED);
        return sent(err, wants, ino, notify);
    }
    if (op == OP_READLINK) { /* a link's data is its target */
        pthread_mutex_lock(&self->mu);
        const char *data = e->data;
        Py_ssize_t dlen = e->len;
        pthread_mutex_unlock(&self->mu);
        if (data == NULL)
            return 0;
        err = reply(self->fd, unique, data, (size_t)dlen);
        return sent(err, 0, ino, notify);
    }
    if (op == OP_READDIRPLUS) {
        pthread_mutex_lock(&self->mu);
        const char *list = e->list_obj ? PyBytes_AS_STRING(e->list_obj) : NULL;
        const uint32_t *starts = e->list_off;
        uint32_t n = e->list_n;
        int wants = list != NULL && e->notify;
        if (wants)
            e->notify = 0;
        pthread_mutex_unlock(&self->mu);
        if (list == NULL)
            return 0;
        /* whole records from record `off` on, as many as fit in size */
        size_t from = 0, to = 0;
        if (off < n) {
            from = starts[off];
            uint32_t j = (uint32_t)off;
            while (j < n && starts[j + 1] - from <= size)
                j++;
            to = starts[j];
        }
        err = reply(self->fd, unique, list + from, to - from);
        return sent(err, wants, ino, notify);
    }
    if (op == OP_LOOKUP) {
        const unsigned char *nul = memchr(body, 0, blen);
        if (nul == NULL)
            return 0;
        size_t len = (size_t)(nul - body);
        unsigned char out[ENTRY_OUT];
        int known = 0;
        pthread_mutex_lock(&self->mu);
        if (e->named) {
            Name *slot = self->names_cap ? name_slot(self, ino, (const char *)body, len) : NULL;
            memcpy(out, slot && slot->name ? slot->entry : self->negative, ENTRY_OUT);
            known = 1;
        }
        pthread_mutex_unlock(&self->mu);
        if (!known)
            return 0;
        err = reply(self->fd, unique, out, sizeof out);
        return sent(err, 0, ino, notify);
    }
    if (op == OP_GETATTR) {
        unsigned char out[ATTR_OUT];
        pthread_mutex_lock(&self->mu);
        int known = e->attr != NULL;
        if (known)
            memcpy(out, e->attr, ATTR_OUT);
        pthread_mutex_unlock(&self->mu);
        if (!known)
            return 0;
        err = reply(self->fd, unique, out, sizeof out);
        return sent(err, 0, ino, notify);
    }
    return 0;
}

/* The next request Python must answer (bytes), an inode whose inline read Python asked to
 * hear of (int), or None once the mount is gone (ENODEV). */
static PyObject *Loop_next(Loop *self, PyObject *unused) {
    if (self->tab == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Loop not initialised");
        return NULL;
    }
    unsigned char *buf = malloc(REQUEST_BUFFER);
    if (buf == NULL)
        return PyErr_NoMemory();
    for (;;) {
        ssize_t n;
        int err = 0, got = 0;
        uint64_t notify = 0;
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            n = read(self->fd, buf, REQUEST_BUFFER);
            if (n < 0) {
                err = errno;
                if (err == ENOENT || err == EAGAIN)
                    continue; /* an interrupted request: the kernel has forgotten it */
                break;
            }
            if (n == 0) { /* end of file: not /dev/fuse's way, but the peer is gone */
                err = ENODEV;
                n = -1;
                break;
            }
            if ((size_t)n < IN_HEADER)
                continue; /* never sent by the kernel */
            int r = answer(self, buf, (size_t)n, &notify);
            if (r == 0) {
                got = 1;
                break;
            }
            if (r < 0) {
                err = -r;
                n = -1;
                break;
            }
            __atomic_fetch_add(&self->answered, 1, __ATOMIC_RELAXED);
            uint32_t op;
            memcpy(&op, buf + 4, 4);
            __atomic_fetch_add(&self->by_op[op & 63], 1, __ATOMIC_RELAXED);
            if (r == 2)
                break;
        }
        Py_END_ALLOW_THREADS
        if (notify) {
            free(buf);
            return PyLong_FromUnsignedLongLong(notify);
        }
        if (got) {
            __atomic_fetch_add(&self->handed, 1, __ATOMIC_RELAXED);
            uint32_t len, op;
            memcpy(&len, buf, 4);
            memcpy(&op, buf + 4, 4);
            __atomic_fetch_add(&self->handed_by_op[op & 63], 1, __ATOMIC_RELAXED);
            PyObject *out = PyBytes_FromStringAndSize((char *)buf, len < (size_t)n ? len : n);
            free(buf);
            return out;
        }
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) { /* a signal handler raised (SIGTERM ends serve) */
                free(buf);
                return NULL;
            }
            continue;
        }
        free(buf);
        if (err == ENODEV)
            Py_RETURN_NONE; /* unmounted */
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyMethodDef Loop_methods[] = {
    {"next", (PyCFunction)Loop_next, METH_NOARGS,
     "The next request for Python (bytes), an inode whose inline read it asked to hear of "
     "(int), or None when the mount is gone."},
    {"set_open", (PyCFunction)Loop_set_open, METH_VARARGS,
     "set_open(ino, open_flags, backing_id): answer OPENs of ino here."},
    {"set_data", (PyCFunction)Loop_set_data, METH_VARARGS,
     "set_data(ino, data, notify, offset=0, length=-1, cost=length) -> bool: answer READs "
     "of ino from data[offset:offset+length] (data kept, not copied, until the loop is "
     "freed; cost counted against the budget; False when already set or over it)."},
    {"has_data", (PyCFunction)Loop_has_data, METH_VARARGS, "has_data(ino) -> bool"},
    {"set_notify", (PyCFunction)Loop_set_notify, METH_VARARGS,
     "set_notify(ino, flag): whether next() reports the next inline read of ino."},
    {"set_attr", (PyCFunction)Loop_set_attr, METH_VARARGS,
     "set_attr(ino, attr_out): answer GETATTRs of ino with these 104 bytes."},
    {"set_names", (PyCFunction)Loop_set_names, METH_VARARGS,
     "set_names(dir_ino, [(name, entry_out)]): answer every LOOKUP in dir_ino here (a name "
     "not given is answered with a negative entry)."},
    {"set_listing", (PyCFunction)Loop_set_listing, METH_VARARGS,
     "set_listing(dir_ino, records, starts): answer READDIRPLUS of dir_ino from its whole "
     "listing (record i, the entry at offset i, starts at starts[i])."},
    {"record_until", (PyCFunction)Loop_record_until, METH_O,
     "record_until(monotonic_seconds): log first opens answered here until then."},
    {"opens", (PyCFunction)Loop_opens, METH_NOARGS,
     "First opens answered here since the last call: [(ino, monotonic seconds)]."},
    {"counters", (PyCFunction)Loop_counters, METH_NOARGS,
     "Requests answered here, bytes served, requests handed to Python, inline bytes held."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_fuseloop.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled FUSE request loop of one mount.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Loop_init,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_methods = Loop_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fuseloop",
                                    "The compiled FUSE request loop (kernelfs.py).", -1, NULL};

PyMODINIT_FUNC PyInit__fuseloop(void) {
    if (PyType_Ready(&LoopType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(m, "Loop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(&LoopType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
