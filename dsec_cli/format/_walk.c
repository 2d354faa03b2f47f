/* The compiled half of the build's per-file path (format/tree.py): a sorted lstat walk
 * that never follows a symlink below its root, a stat listing for build fingerprints, and
 * batched file reads done without the GIL.
 *
 * Every function gives exactly what its pure-Python twin in tree.py gives; the Python
 * side turns records into index entries, so the format rules live in one place.
 *
 * Built by scripts/setup.sh with gcc and the Python headers; where it is not built, the
 * pure-Python path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <sys/syscall.h>

#define DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

/* listxattrat(2) (Linux 6.13) lists a name's xattrs through its parent's fd without the
 * /proc/self/fd detour; the same number on every architecture */
#define SYS_LISTXATTRAT 465
static int have_listxattrat = 1;

/* 1 when the name has no xattrs at all (the common case, answered with one cheap call);
 * 0 when it may have some or the kernel cannot tell */
static int surely_no_xattrs(int dfd, const char *name) {
    if (!have_listxattrat)
        return 0;
    long n = syscall(SYS_LISTXATTRAT, dfd, name, AT_SYMLINK_NOFOLLOW, NULL, 0);
    if (n < 0 && (errno == ENOSYS || errno == EPERM)) {
        have_listxattrat = 0;
        return 0;
    }
    return n == 0;
}

/* -- scanning ------------------------------------------------------------------------------ */

static PyObject *os_error(int err, PyObject *name) {
    errno = err;
    if (name != NULL)
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    else
        PyErr_SetFromErrno(PyExc_OSError);
    return NULL;
}

/* [(name, value), ...] of a file's xattrs, in listxattr order; an empty list when they
 * cannot be listed (as os.listxattr errors are ignored by the Python walk). fd >= 0: through
 * the fd; else through path without following it. */
static PyObject *read_xattrs(int fd, const char *path) {
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    char stackbuf[1024];
    char *names = stackbuf;
    ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    n = fd >= 0 ? flistxattr(fd, names, sizeof(stackbuf)) : llistxattr(path, names, sizeof(stackbuf));
    Py_END_ALLOW_THREADS
    if (n < 0 && errno == ERANGE) {
        ssize_t want = fd >= 0 ? flistxattr(fd, NULL, 0) : llistxattr(path, NULL, 0);
        if (want <= 0)
            return out;
        names = malloc((size_t)want);
        if (names == NULL) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        n = fd >= 0 ? flistxattr(fd, names, (size_t)want) : llistxattr(path, names, (size_t)want);
    }
    if (n <= 0) {
        if (names != stackbuf)
            free(names);
        return out;
    }
    for (char *p = names; p < names + n; p += strlen(p) + 1) {
        if (*p == '\0')
            continue;
        ssize_t vlen = fd >= 0 ? fgetxattr(fd, p, NULL, 0) : lgetxattr(path, p, NULL, 0);
        if (vlen < 0)
            continue; /* os.getxattr errors are skipped by the Python walk */
        PyObject *val = PyBytes_FromStringAndSize(NULL, vlen);
        if (val == NULL)
            goto fail;
        ssize_t got = vlen == 0 ? 0
                                : (fd >= 0 ? fgetxattr(fd, p, PyBytes_AS_STRING(val), (size_t)vlen)
                                           : lgetxattr(path, p, PyBytes_AS_STRING(val), (size_t)vlen));
        if (got < 0) {
            Py_DECREF(val);
            continue;
        }
        if (got != vlen && _PyBytes_Resize(&val, got) < 0)
            goto fail;
        PyObject *key = PyUnicode_DecodeFSDefault(p);
        if (key == NULL) {
            Py_DECREF(val);
            goto fail;
        }
        PyObject *pair = PyTuple_Pack(2, key, val);
        Py_DECREF(key);
        Py_DECREF(val);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
    }
    if (names != stackbuf)
        free(names);
    return out;
fail:
    if (names != stackbuf)
        free(names);
    Py_DECREF(out);
    return NULL;
}

/* The sorted names in a directory, as str (os.fsdecode), like sorted(os.listdir(fd)). */
static PyObject *sorted_names(int dfd) {
    int fd = dup(dfd);
    if (fd < 0)
        return os_error(errno, NULL);
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        int err = errno;
        close(fd);
        return os_error(err, NULL);
    }
    rewinddir(d);
    PyObject *names = PyList_New(0);
    if (names == NULL)
        goto done;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (de == NULL) {
            if (errno != 0) {
                Py_CLEAR(names);
                os_error(errno, NULL);
            }
            break;
        }
        const char *n = de->d_name;
        if (n[0] == '.' && (n[1] == '\0' || (n[1] == '.' && n[2] == '\0')))
            continue;
        PyObject *s = PyUnicode_DecodeFSDefault(n);
        if (s == NULL || PyList_Append(names, s) < 0) {
            Py_XDECREF(s);
            Py_CLEAR(names);
            break;
        }
        Py_DECREF(s);
    }
    if (names != NULL && PyList_Sort(names) < 0)
        Py_CLEAR(names);
done:
    closedir(d);
    return names;
}

typedef struct {
    PyObject *out;
    int xattrs; /* 0: skip xattrs (records carry None), for stat listings */
} Walk;

static int visit(Walk *w, int dfd, PyObject *name, PyObject *rel, const struct stat *given,
                 int given_fd);

/* One record: (rel, st_mode, uid, gid, mtime_ns, size, nlink, dev, ino, rdev_major,
 * rdev_minor, ctime_ns, link target or None, [(xattr, value)] or None). */
static int emit(Walk *w, PyObject *rel, const struct stat *st, PyObject *target, PyObject *xattrs) {
    long long mt = (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    long long ct = (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec;
    PyObject *rec = Py_BuildValue("(OIIILLKKKIILOO)", rel, (unsigned)st->st_mode,
                                  (unsigned)st->st_uid, (unsigned)st->st_gid, mt,
                                  (long long)st->st_size, (unsigned long long)st->st_nlink,
                                  (unsigned long long)st->st_dev, (unsigned long long)st->st_ino,
                                  (unsigned)major(st->st_rdev), (unsigned)minor(st->st_rdev), ct,
                                  target ? target : Py_None, xattrs ? xattrs : Py_None);
    if (rec == NULL)
        return -1;
    int r = PyList_Append(w->out, rec);
    Py_DECREF(rec);
    return r;
}

static int visit(Walk *w, int dfd, PyObject *name, PyObject *rel, const struct stat *given,
                 int given_fd) {
    struct stat stbuf;
    const struct stat *st = given;
    PyObject *bname = NULL, *target = NULL, *xattrs = NULL, *names = NULL;
    int sub_fd = given_fd, own_fd = 0, rc = -1, entered = 0;
    if (st == NULL) {
        bname = PyUnicode_EncodeFSDefault(name);
        if (bname == NULL)
            return -1;
        const char *cn = PyBytes_AS_STRING(bname);
        if (fstatat(dfd, cn, &stbuf, AT_SYMLINK_NOFOLLOW) < 0) {
            os_error(errno, name);
            goto out;
        }
        st = &stbuf;
        if (S_ISDIR(st->st_mode)) {
            sub_fd = openat(dfd, cn, DIR_FLAGS);
            if (sub_fd < 0) {
                os_error(errno, name);
                goto out;
            }
            own_fd = 1;
        }
    }
    if (S_ISLNK(st->st_mode)) {
        /* on the heap: this frame stays on the stack while the walk recurses */
        char *buf = malloc(PATH_MAX + 1);
        if (buf == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        ssize_t n = readlinkat(dfd, PyBytes_AS_STRING(bname), buf, PATH_MAX);
        if (n < 0) {
            free(buf);
            os_error(errno, name);
            goto out;
        }
        target = PyUnicode_DecodeFSDefaultAndSize(buf, n);
        free(buf);
        if (target == NULL)
            goto out;
    } else if (!w->xattrs) {
        xattrs = Py_NewRef(Py_None);
    } else if (sub_fd >= 0) {
        xattrs = read_xattrs(sub_fd, NULL);
    } else {
        char path[64 + NAME_MAX + 1];
        if (surely_no_xattrs(dfd, PyBytes_AS_STRING(bname))) {
            xattrs = PyList_New(0);
            goto emit;
        }
        snprintf(path, sizeof(path), "/proc/self/fd/%d/%s", dfd, PyBytes_AS_STRING(bname));
        xattrs = read_xattrs(-1, path);
    }
emit:
    if (!S_ISLNK(st->st_mode) && xattrs == NULL)
        goto out;
    if (emit(w, rel, st, target, xattrs == Py_None ? NULL : xattrs) < 0)
        goto out;
    if (sub_fd >= 0) {
        names = sorted_names(sub_fd);
        if (names == NULL)
            goto out;
        /* as deep as Python's own recursion limit allows, like the Python walk: a hostile
         * tree nested without end is a RecursionError, never a stack overflow */
        if (Py_EnterRecursiveCall(" while walking a tree"))
            goto out;
        entered = 1;
        int is_root = PyUnicode_CompareWithASCIIString(rel, ".") == 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(names); i++) {
            PyObject *child = PyList_GET_ITEM(names, i);
            PyObject *crel = is_root ? (Py_INCREF(child), child)
                                     : PyUnicode_FromFormat("%U/%U", rel, child);
            if (crel == NULL)
                goto out;
            int r = visit(w, sub_fd, child, crel, NULL, -1);
            Py_DECREF(crel);
            if (r < 0)
                goto out;
        }
    }
    rc = 0;
out:
    if (entered)
        Py_LeaveRecursiveCall();
    if (own_fd)
        close(sub_fd);
    Py_XDECREF(bname);
    Py_XDECREF(target);
    Py_XDECREF(xattrs);
    Py_XDECREF(names);
    return rc;
}

static PyObject *walk_scan(PyObject *self, PyObject *args) {
    PyObject *root;
    int with_xattrs = 1;
    if (!PyArg_ParseTuple(args, "O&|p", PyUnicode_FSConverter, &root, &with_xattrs))
        return NULL;
    int fd = open(PyBytes_AS_STRING(root), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        PyObject *r = os_error(errno, root);
        Py_DECREF(root);
        return r;
    }
    Py_DECREF(root);
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int err = errno;
        close(fd);
        return os_error(err, NULL);
    }
    Walk w = {PyList_New(0), with_xattrs};
    PyObject *dot = PyUnicode_FromString(".");
    if (w.out == NULL || dot == NULL || visit(&w, fd, dot, dot, &st, fd) < 0) {
        Py_CLEAR(w.out);
    }
    Py_XDECREF(dot);
    close(fd);
    return w.out;
}

/* -- stat listing ------------------------------------------------------------------------ */

/* The stat listing of a tree, for build fingerprints: one line per path in pre-order, the
 * names of a directory sorted as bytes, each ``rel\0size\0mtime_ns\0ctime_ns\0mode\0ino\n``
 * (the root is "."; decimal numbers). Nothing is read but directories and inodes, and no
 * Python object is made per path: this is what a no-op build costs. The walk runs without
 * the GIL (a build lists its inputs on one thread while it scans them on another): a
 * failure is kept in ``Listing`` and raised once the GIL is held again. */
typedef struct {
    char *buf;
    size_t len, cap;
} Buf;

typedef struct {
    Buf out, rel;
    int depth, max_depth;
    int err;       /* errno of the failed call, 0 if none */
    int nomem;     /* an allocation failed */
    int too_deep;  /* nested deeper than the interpreter's recursion limit */
    char *name;    /* the name the failed call was about, or NULL */
} Listing;

static int buf_put(Listing *L, Buf *b, const char *p, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->len + n)
            cap *= 2;
        char *nb = realloc(b->buf, cap);
        if (nb == NULL) {
            L->nomem = 1;
            return -1;
        }
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, p, n);
    b->len += n;
    return 0;
}

static int list_fail(Listing *L, int err, const char *name) {
    L->err = err;
    if (name != NULL && L->name == NULL)
        L->name = strdup(name);
    return -1;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int list_line(Listing *L, const char *rel, size_t rlen, const struct stat *st) {
    char nums[128];
    long long mt = (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    long long ct = (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec;
    int n = snprintf(nums, sizeof(nums), "%c%lld%c%lld%c%lld%c%u%c%llu\n", 0,
                     (long long)st->st_size, 0, mt, 0, ct, 0, (unsigned)st->st_mode, 0,
                     (unsigned long long)st->st_ino);
    if (buf_put(L, &L->out, rel, rlen) < 0 || buf_put(L, &L->out, nums, (size_t)n) < 0)
        return -1;
    return 0;
}

/* the entries of directory dfd below ``L->rel`` (a growable path buffer) */
static int list_dir(Listing *L, int dfd) {
    int fd = dup(dfd), rc = -1;
    if (fd < 0)
        return list_fail(L, errno, NULL);
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        list_fail(L, errno, NULL);
        close(fd);
        return -1;
    }
    rewinddir(d);
    char **names = NULL;
    size_t n = 0, cap = 0, i;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (de == NULL) {
            if (errno != 0) {
                list_fail(L, errno, NULL);
                goto out;
            }
            break;
        }
        const char *nm = de->d_name;
        if (nm[0] == '.' && (nm[1] == '\0' || (nm[1] == '.' && nm[2] == '\0')))
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **nn = realloc(names, cap * sizeof(char *));
            if (nn == NULL) {
                L->nomem = 1;
                goto out;
            }
            names = nn;
        }
        if ((names[n] = strdup(nm)) == NULL) {
            L->nomem = 1;
            goto out;
        }
        n++;
    }
    qsort(names, n, sizeof(char *), cmp_names);
    Buf *rel = &L->rel;
    size_t base = rel->len;
    for (i = 0; i < n; i++) {
        rel->len = base;
        if ((base && buf_put(L, rel, "/", 1) < 0) ||
            buf_put(L, rel, names[i], strlen(names[i])) < 0)
            goto out;
        struct stat st;
        if (fstatat(dirfd(d), names[i], &st, AT_SYMLINK_NOFOLLOW) < 0) {
            list_fail(L, errno, names[i]);
            goto out;
        }
        if (list_line(L, rel->buf, rel->len, &st) < 0)
            goto out;
        if (S_ISDIR(st.st_mode)) {
            /* a tree nested without end is a RecursionError, never a stack overflow */
            if (++L->depth > L->max_depth) {
                L->too_deep = 1;
                goto out;
            }
            int sub = openat(dirfd(d), names[i], DIR_FLAGS);
            if (sub < 0) {
                list_fail(L, errno, NULL);
                goto out;
            }
            int r = list_dir(L, sub);
            L->depth--;
            close(sub);
            if (r < 0)
                goto out;
        }
    }
    rel->len = base;
    rc = 0;
out:
    for (i = 0; i < n; i++)
        free(names[i]);
    free(names);
    closedir(d);
    return rc;
}

static PyObject *walk_stat_listing(PyObject *self, PyObject *args) {
    PyObject *root;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &root))
        return NULL;
    /* the root is the caller's own path and followed (a spec's source may be a symlink);
     * nothing below it is */
    const char *path = PyBytes_AS_STRING(root);
    Listing L;
    memset(&L, 0, sizeof(L));
    L.max_depth = Py_GetRecursionLimit();
    int rc = 0, root_err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct stat st;
    if (stat(path, &st) < 0) {
        root_err = errno;
        rc = -1;
    } else if (list_line(&L, ".", 1, &st) < 0) {
        rc = -1;
    } else if (S_ISDIR(st.st_mode)) {
        int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) {
            root_err = errno;
            rc = -1;
        } else {
            rc = list_dir(&L, fd);
            close(fd);
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (rc == 0) {
        result = PyBytes_FromStringAndSize(L.out.buf, (Py_ssize_t)L.out.len);
    } else if (root_err) {
        os_error(root_err, root);
    } else if (L.nomem) {
        PyErr_NoMemory();
    } else if (L.too_deep) {
        PyErr_SetString(PyExc_RecursionError,
                        "maximum recursion depth exceeded while listing a tree");
    } else {
        PyObject *nm = L.name ? PyUnicode_DecodeFSDefault(L.name) : NULL;
        if (L.name != NULL && nm == NULL)
            PyErr_Clear();
        os_error(L.err, nm);
        Py_XDECREF(nm);
    }
    free(L.name);
    free(L.out.buf);
    free(L.rel.buf);
    Py_DECREF(root);
    return result;
}

/* -- reading ------------------------------------------------------------------------------- */

/* read_many(paths, limit) -> [(size, data or None)]: each file opened (following its path as
 * os.open does), its size taken with fstat, and when 0 < size <= limit its bytes read (up to
 * size: a file that shrinks gives fewer). The GIL is released around the system calls. */
static PyObject *walk_read_many(PyObject *self, PyObject *args) {
    PyObject *seq;
    long long limit;
    if (!PyArg_ParseTuple(args, "OL", &seq, &limit))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "paths must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **enc = calloc((size_t)n + 1, sizeof(PyObject *));
    int *fds = malloc(((size_t)n + 1) * sizeof(int));
    off_t *sizes = calloc((size_t)n + 1, sizeof(off_t));
    int *errs = calloc((size_t)n + 1, sizeof(int));
    char **bufs = calloc((size_t)n + 1, sizeof(char *));
    PyObject **datas = calloc((size_t)n + 1, sizeof(PyObject *));
    ssize_t *got = calloc((size_t)n + 1, sizeof(ssize_t));
    PyObject *out = NULL;
    Py_ssize_t i;
    if (!enc || !fds || !sizes || !errs || !bufs || !datas || !got) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++)
        fds[i] = -1;
    for (i = 0; i < n; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &enc[i]))
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        struct stat st;
        fds[i] = open(PyBytes_AS_STRING(enc[i]), O_RDONLY | O_CLOEXEC);
        if (fds[i] < 0) {
            errs[i] = errno;
            break; /* the first failure is raised: nothing after it is needed */
        }
        if (fstat(fds[i], &st) < 0) {
            errs[i] = errno;
            break;
        }
        sizes[i] = st.st_size;
    }
    Py_END_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        if (errs[i]) {
            os_error(errs[i], PySequence_Fast_GET_ITEM(fast, i));
            goto done;
        }
        if (sizes[i] > 0 && sizes[i] <= limit) {
            datas[i] = PyBytes_FromStringAndSize(NULL, sizes[i]);
            if (datas[i] == NULL)
                goto done;
            bufs[i] = PyBytes_AS_STRING(datas[i]);
        }
    }
    /* the new bytes objects are not shared yet: filling them without the GIL is safe */
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        if (bufs[i] == NULL)
            continue;
        ssize_t have = 0;
        while (have < sizes[i]) {
            ssize_t r = read(fds[i], bufs[i] + have, (size_t)(sizes[i] - have));
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0) {
                errs[i] = errno;
                break;
            }
            if (r == 0)
                break; /* shrank since fstat */
            have += r;
        }
        got[i] = have;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (i = 0; i < n; i++) {
        if (errs[i]) {
            Py_CLEAR(out);
            os_error(errs[i], PySequence_Fast_GET_ITEM(fast, i));
            goto done;
        }
        PyObject *data = Py_None;
        if (datas[i] != NULL) {
            if (got[i] != sizes[i] && _PyBytes_Resize(&datas[i], got[i]) < 0) {
                Py_CLEAR(out);
                goto done;
            }
            data = datas[i];
        }
        PyObject *item = Py_BuildValue("(LO)", (long long)sizes[i], data);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    if (fds)
        for (i = 0; i < n; i++)
            if (fds[i] >= 0)
                close(fds[i]);
    if (enc)
        for (i = 0; i < n; i++)
            Py_XDECREF(enc[i]);
    if (datas)
        for (i = 0; i < n; i++)
            Py_XDECREF(datas[i]);
    free(enc);
    free(fds);
    free(sizes);
    free(errs);
    free(bufs);
    free(datas);
    free(got);
    Py_DECREF(fast);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", walk_scan, METH_VARARGS,
     "scan(root, xattrs=True) -> records of every path under root, sorted, never following a symlink"},
    {"stat_listing", walk_stat_listing, METH_VARARGS,
     "stat_listing(root) -> bytes: a line per path (rel, size, mtime, ctime, mode, inode)"},
    {"read_many", walk_read_many, METH_VARARGS,
     "read_many(paths, limit) -> [(size, bytes or None)], read without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_walk", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__walk(void) { return PyModule_Create(&module); }
