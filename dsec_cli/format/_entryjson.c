/* Index entries as canonical JSON, in one call per slice of entries.
 *
 * A layer index stores its entries twice over as JSON (the stored array, with chunk numbers,
 * and the array its content digest is taken over, with chunk ids): `json.dumps` of one small
 * dict per entry, keys sorted, compact separators, non-ASCII as UTF-8. Built in Python that
 * is about 10 us an entry, half of it making the dicts; here it is written straight from the
 * Entry objects. The bytes must be exactly what `canonical.dumps` gives (digests are taken
 * over them), so this writes only the common shape of an entry: an entry with xattrs, a
 * device number, a name that is not valid UTF-8, or a field of an unexpected type goes to
 * ``fallback(entry)``, which returns its two items made the Python way.
 * tests/format/test_entryjson.py checks both ways give the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static int grow(Buf *b, size_t more)
{
    if (b->len + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const char *s, size_t n)
{
    if (grow(b, n) < 0)
        return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

#define PUTS(b, lit) put((b), (lit), sizeof(lit) - 1)

static int put_int(Buf *b, long long v)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof(tmp), "%lld", v);
    return put(b, tmp, (size_t)n);
}

/* a JSON string as json.dumps(ensure_ascii=False) writes it, UTF-8 encoded */
static int put_str(Buf *b, const char *s, Py_ssize_t n)
{
    static const char hex[] = "0123456789abcdef";
    if (grow(b, (size_t)n + 2) < 0)
        return -1;
    b->p[b->len++] = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        default: break;
        }
        if (esc != NULL) {
            if (put(b, esc, 2) < 0)
                return -1;
        } else if (c < 0x20) {
            char u[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            if (put(b, u, 6) < 0)
                return -1;
        } else {
            if (grow(b, 2) < 0)
                return -1;
            b->p[b->len++] = (char)c;
        }
    }
    if (grow(b, 1) < 0)
        return -1;
    b->p[b->len++] = '"';
    return 0;
}

static PyObject *a_path, *a_type, *a_mode, *a_uid, *a_gid, *a_mtime, *a_size, *a_target,
    *a_rdev, *a_xattrs, *a_opaque, *a_chunks;

/* 1: an exact int that fits, in *out; 0: not (the entry goes to the fallback) */
static int exact_int(PyObject *o, long long *out)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* UTF-8 of an exact str, or NULL (error cleared) when it has none (a lone surrogate) */
static const char *utf8(PyObject *o, Py_ssize_t *n)
{
    if (!PyUnicode_CheckExact(o))
        return NULL;
    const char *s = PyUnicode_AsUTF8AndSize(o, n);
    if (s == NULL)
        PyErr_Clear();
    return s;
}

typedef struct {
    PyObject *path, *type, *mode, *uid, *gid, *mtime, *size, *target, *rdev, *xattrs,
        *opaque, *chunks;
} Fields;

static void release(Fields *f)
{
    Py_XDECREF(f->path); Py_XDECREF(f->type); Py_XDECREF(f->mode); Py_XDECREF(f->uid);
    Py_XDECREF(f->gid); Py_XDECREF(f->mtime); Py_XDECREF(f->size); Py_XDECREF(f->target);
    Py_XDECREF(f->rdev); Py_XDECREF(f->xattrs); Py_XDECREF(f->opaque);
    Py_XDECREF(f->chunks);
}

/* Write one entry's stored and content items. Returns 0 written, 1 not this shape (nothing
 * written), -1 error. */
static int entry(PyObject *e, PyObject *ids, Buf *st, Buf *ct)
{
    Fields f = {0};
    int rc = 1;
    if (!(f.path = PyObject_GetAttr(e, a_path)) || !(f.type = PyObject_GetAttr(e, a_type)) ||
        !(f.mode = PyObject_GetAttr(e, a_mode)) || !(f.uid = PyObject_GetAttr(e, a_uid)) ||
        !(f.gid = PyObject_GetAttr(e, a_gid)) || !(f.mtime = PyObject_GetAttr(e, a_mtime)) ||
        !(f.size = PyObject_GetAttr(e, a_size)) ||
        !(f.target = PyObject_GetAttr(e, a_target)) ||
        !(f.rdev = PyObject_GetAttr(e, a_rdev)) ||
        !(f.xattrs = PyObject_GetAttr(e, a_xattrs)) ||
        !(f.opaque = PyObject_GetAttr(e, a_opaque)) ||
        !(f.chunks = PyObject_GetAttr(e, a_chunks))) {
        rc = -1;
        goto out;
    }
    Py_ssize_t np, nt, nl;
    const char *path = utf8(f.path, &np), *type = utf8(f.type, &nt),
               *target = utf8(f.target, &nl);
    long long mode, uid, gid, mtime, size;
    if (!path || !type || !target || f.rdev != Py_None || !PyDict_CheckExact(f.xattrs) ||
        PyDict_GET_SIZE(f.xattrs) || (f.opaque != Py_True && f.opaque != Py_False) ||
        !PyList_CheckExact(f.chunks) || !exact_int(f.mode, &mode) ||
        !exact_int(f.uid, &uid) || !exact_int(f.gid, &gid) || !exact_int(f.mtime, &mtime) ||
        !exact_int(f.size, &size))
        goto out;
    Py_ssize_t nc = PyList_GET_SIZE(f.chunks), nids = PyList_GET_SIZE(ids);
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *c = PyList_GET_ITEM(f.chunks, i);
        long long v;
        if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 3 ||
            !exact_int(PyTuple_GET_ITEM(c, 0), &v) || v < 0 || v >= nids ||
            !PyBytes_CheckExact(PyList_GET_ITEM(ids, v)) ||
            !exact_int(PyTuple_GET_ITEM(c, 1), &v) || !exact_int(PyTuple_GET_ITEM(c, 2), &v))
            goto out;
    }
    int whiteout = nt == 8 && memcmp(type, "whiteout", 8) == 0;
    rc = -1;
    for (int pass = 0; pass < 2; pass++) {
        Buf *b = pass ? ct : st;
        if (PUTS(b, "{") < 0)
            goto out;
        int first = 1;
#define KEY(lit) do { if (!first && PUTS(b, ",") < 0) goto out; first = 0; \
                      if (PUTS(b, lit) < 0) goto out; } while (0)
        if (nc) {
            KEY("\"c\":[");
            for (Py_ssize_t i = 0; i < nc; i++) {
                PyObject *c = PyList_GET_ITEM(f.chunks, i);
                long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 0));
                if ((i && PUTS(b, ",") < 0) || PUTS(b, "[") < 0)
                    goto out;
                if (pass) {
                    PyObject *id = PyList_GET_ITEM(ids, n);
                    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(id);
                    Py_ssize_t dn = PyBytes_GET_SIZE(id);
                    static const char hex[] = "0123456789abcdef";
                    if (grow(b, (size_t)dn * 2 + 2) < 0)
                        goto out;
                    b->p[b->len++] = '"';
                    for (Py_ssize_t k = 0; k < dn; k++) {
                        b->p[b->len++] = hex[d[k] >> 4];
                        b->p[b->len++] = hex[d[k] & 15];
                    }
                    b->p[b->len++] = '"';
                } else if (put_int(b, n) < 0) {
                    goto out;
                }
                if (PUTS(b, ",") < 0 || put_int(b, PyLong_AsLongLong(PyTuple_GET_ITEM(c, 1))) < 0 ||
                    PUTS(b, ",") < 0 || put_int(b, PyLong_AsLongLong(PyTuple_GET_ITEM(c, 2))) < 0 ||
                    PUTS(b, "]") < 0)
                    goto out;
            }
            if (PUTS(b, "]") < 0)
                goto out;
        }
        if (!whiteout) {
            KEY("\"g\":");
            if (put_int(b, gid) < 0)
                goto out;
        }
        if (nl) {
            KEY("\"l\":");
            if (put_str(b, target, nl) < 0)
                goto out;
        }
        if (!whiteout) {
            KEY("\"m\":");
            if (put_int(b, mode) < 0 || PUTS(b, ",\"mt\":") < 0 || put_int(b, mtime) < 0)
                goto out;
        }
        if (f.opaque == Py_True)
            KEY("\"o\":true");
        KEY("\"p\":");
        if (put_str(b, path, np) < 0)
            goto out;
        if (size) {
            KEY("\"s\":");
            if (put_int(b, size) < 0)
                goto out;
        }
        KEY("\"t\":");
        if (put_str(b, type, nt) < 0)
            goto out;
        if (!whiteout) {
            KEY("\"u\":");
            if (put_int(b, uid) < 0)
                goto out;
        }
        if (PUTS(b, "}") < 0)
            goto out;
#undef KEY
    }
    rc = 0;
out:
    if (rc < 0 && PyErr_Occurred() == NULL)
        PyErr_SetString(PyExc_RuntimeError, "entry serialization failed");
    release(&f);
    return rc;
}

/* items(entries, ids, fallback) -> (stored items, content items), each the items of the
 * canonical JSON array of the entries' documents, comma-separated, without the brackets */
static PyObject *entryjson_items(PyObject *self, PyObject *args)
{
    PyObject *entries, *ids, *fallback;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &entries, &PyList_Type, &ids,
                          &fallback))
        return NULL;
    Buf st = {0}, ct = {0};
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i && (PUTS(&st, ",") < 0 || PUTS(&ct, ",") < 0))
            goto done;
        PyObject *e = PyList_GET_ITEM(entries, i);
        int rc = entry(e, ids, &st, &ct);
        if (rc < 0)
            goto done;
        if (rc == 1) {
            PyObject *pair = PyObject_CallOneArg(fallback, e);
            if (pair == NULL)
                goto done;
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
                !PyBytes_Check(PyTuple_GET_ITEM(pair, 0)) ||
                !PyBytes_Check(PyTuple_GET_ITEM(pair, 1))) {
                Py_DECREF(pair);
                PyErr_SetString(PyExc_TypeError, "fallback must return two bytes");
                goto done;
            }
            PyObject *a = PyTuple_GET_ITEM(pair, 0), *b = PyTuple_GET_ITEM(pair, 1);
            int bad = put(&st, PyBytes_AS_STRING(a), (size_t)PyBytes_GET_SIZE(a)) < 0 ||
                      put(&ct, PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b)) < 0;
            Py_DECREF(pair);
            if (bad)
                goto done;
        }
    }
    out = Py_BuildValue("(y#y#)", st.p ? st.p : "", (Py_ssize_t)st.len, ct.p ? ct.p : "",
                        (Py_ssize_t)ct.len);
done:
    PyMem_Free(st.p);
    PyMem_Free(ct.p);
    return out;
}

static PyMethodDef methods[] = {
    {"items", entryjson_items, METH_VARARGS,
     "items(entries, ids, fallback) -> (stored items, content items) of the entries' "
     "canonical JSON arrays, without the brackets"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_entryjson", NULL, -1, methods};

PyMODINIT_FUNC PyInit__entryjson(void)
{
    if (!(a_path = PyUnicode_InternFromString("path")) ||
        !(a_type = PyUnicode_InternFromString("type")) ||
        !(a_mode = PyUnicode_InternFromString("mode")) ||
        !(a_uid = PyUnicode_InternFromString("uid")) ||
        !(a_gid = PyUnicode_InternFromString("gid")) ||
        !(a_mtime = PyUnicode_InternFromString("mtime")) ||
        !(a_size = PyUnicode_InternFromString("size")) ||
        !(a_target = PyUnicode_InternFromString("target")) ||
        !(a_rdev = PyUnicode_InternFromString("rdev")) ||
        !(a_xattrs = PyUnicode_InternFromString("xattrs")) ||
        !(a_opaque = PyUnicode_InternFromString("opaque")) ||
        !(a_chunks = PyUnicode_InternFromString("chunks")))
        return NULL;
    return PyModule_Create(&module);
}
