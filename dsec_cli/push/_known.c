/* The chunks a store holds, as one compiled hash table (push/dedup.py, `KnownChunks`).

A chunk table cached on disk is a run of 37-byte rows (chunk id, pack number, offset,
stored and plain length, codec; `_REC` in dedup.py). `Table.add` takes such a run whole:
its rows are checked, then copied into one array of rows, each found again through an open
addressing table of row numbers. A library of millions of chunks is then a few tens of
bytes per chunk, loaded at memory speed, where one Python object per chunk took about 300
bytes and two microseconds to make.

The first row added for an id is the one kept (as `dict.setdefault` would). Slots are
chosen by a keyed mix of the id, the key drawn per table by the caller, so ids chosen to
collide (a hostile index in the store) cannot be lined up into long probe runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define REC 37

typedef struct {
    uint8_t id[16];
    uint64_t offset;
    uint32_t pack, clen, ulen;
    uint8_t codec;
} Row;

typedef struct {
    PyObject_HEAD
    Row *rows;
    Py_ssize_t n, cap;
    uint32_t *slots; /* row number + 1; 0: empty */
    uint64_t mask;   /* slots - 1 (a power of two) */
    uint64_t k0, k1;
} Table;

static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t mix(const Table *t, const uint8_t *id) {
    uint64_t h = (le64(id) ^ t->k0) * 0x9E3779B97F4A7C15ULL;
    h ^= (le64(id + 8) ^ t->k1) * 0xC2B2AE3D27D4EB4FULL;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    return h;
}

/* the row number of ``id``, or -1; *slot is where it is or would go */
static Py_ssize_t find(const Table *t, const uint8_t *id, uint64_t *slot) {
    uint64_t i = mix(t, id) & t->mask;
    for (;;) {
        uint32_t s = t->slots[i];
        if (!s) {
            *slot = i;
            return -1;
        }
        if (!memcmp(t->rows[s - 1].id, id, 16))
            return (Py_ssize_t)s - 1;
        i = (i + 1) & t->mask;
    }
}

/* 0, with RuntimeError set, for a Table made without __init__ (no slots yet) */
static int ready(const Table *t) {
    if (!t->slots)
        PyErr_SetString(PyExc_RuntimeError, "Table not initialized");
    return t->slots != NULL;
}

static int grow_slots(Table *t, uint64_t want) {
    uint64_t size = 1024;
    while (size < want * 2)
        size <<= 1;
    if (size - 1 <= t->mask)
        return 0;
    if (size > ((uint64_t)1 << 32))
        return -1;
    uint32_t *slots = PyMem_Calloc(size, sizeof(uint32_t));
    if (!slots)
        return -1;
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = size - 1;
    for (Py_ssize_t r = 0; r < t->n; r++) {
        uint64_t slot;
        find(t, t->rows[r].id, &slot);
        t->slots[slot] = (uint32_t)(r + 1);
    }
    return 0;
}

static int grow_rows(Table *t, Py_ssize_t want) {
    if (want <= t->cap)
        return 0;
    Py_ssize_t cap = t->cap ? t->cap : 1024;
    while (cap < want)
        cap *= 2;
    Row *rows = PyMem_Realloc(t->rows, (size_t)cap * sizeof(Row));
    if (!rows)
        return -1;
    t->rows = rows;
    t->cap = cap;
    return 0;
}

static int Table_init(Table *t, PyObject *args, PyObject *kw) {
    unsigned long long k0, k1;
    static char *names[] = {"k0", "k1", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK", names, &k0, &k1))
        return -1;
    if (t->slots) { /* its rows sit in slots chosen with the keys it has */
        PyErr_SetString(PyExc_RuntimeError, "Table already initialized");
        return -1;
    }
    t->k0 = k0;
    t->k1 = k1;
    if (grow_slots(t, 1) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Table_dealloc(Table *t) {
    PyMem_Free(t->rows);
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

PyDoc_STRVAR(add_doc,
"add(rows, npacks, base) -> bool\n\n"
"Add a chunk table's rows (37 bytes each), their pack numbers below npacks and offset by\n"
"base. False, with nothing added, when the run is not whole rows or names a pack past\n"
"npacks (a damaged table). An id already held keeps its first row.");

static PyObject *Table_add(Table *t, PyObject *args) {
    Py_buffer buf;
    unsigned long npacks, base;
    if (!ready(t))
        return NULL;
    if (!PyArg_ParseTuple(args, "y*kk", &buf, &npacks, &base))
        return NULL;
    const uint8_t *p = buf.buf;
    Py_ssize_t nrows = buf.len / REC;
    PyObject *ok = Py_False;
    if (buf.len % REC || base > UINT32_MAX || npacks > UINT32_MAX - base)
        goto done;
    for (Py_ssize_t i = 0; i < nrows; i++)
        if (le32(p + i * REC + 16) >= npacks)
            goto done;
    if (grow_rows(t, t->n + nrows) < 0 || grow_slots(t, (uint64_t)(t->n + nrows)) < 0) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nrows; i++) {
        const uint8_t *r = p + i * REC;
        uint64_t slot;
        if (find(t, r, &slot) >= 0)
            continue;
        Row *row = &t->rows[t->n];
        memcpy(row->id, r, 16);
        row->pack = le32(r + 16) + (uint32_t)base;
        row->offset = le64(r + 20);
        row->clen = le32(r + 28);
        row->ulen = le32(r + 32);
        row->codec = r[36];
        t->slots[slot] = (uint32_t)(++t->n);
    }
    ok = Py_True;
done:
    PyBuffer_Release(&buf);
    Py_INCREF(ok);
    return ok;
}

static PyObject *row_tuple(const Row *r) {
    return Py_BuildValue("(kKkkB)", (unsigned long)r->pack, (unsigned long long)r->offset,
                         (unsigned long)r->clen, (unsigned long)r->ulen, r->codec);
}

PyDoc_STRVAR(get_doc,
"get(chunk_id) -> (pack, offset, clen, ulen, codec) or None");

static PyObject *Table_get(Table *t, PyObject *arg) {
    Py_buffer buf;
    if (!ready(t))
        return NULL;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    if (buf.len != 16) {
        PyErr_SetString(PyExc_ValueError, "a chunk id is 16 bytes");
    } else {
        uint64_t slot;
        Py_ssize_t r = find(t, buf.buf, &slot);
        if (r < 0) {
            Py_INCREF(Py_None);
            out = Py_None;
        } else {
            out = row_tuple(&t->rows[r]);
        }
    }
    PyBuffer_Release(&buf);
    return out;
}

PyDoc_STRVAR(items_doc,
"items() -> [(chunk_id, pack, offset, clen, ulen, codec)], in the order they were added");

static PyObject *Table_items(Table *t, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New(t->n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        const Row *r = &t->rows[i];
        PyObject *item = Py_BuildValue("(y#kKkkB)", (const char *)r->id, (Py_ssize_t)16,
                                       (unsigned long)r->pack, (unsigned long long)r->offset,
                                       (unsigned long)r->clen, (unsigned long)r->ulen,
                                       r->codec);
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static Py_ssize_t Table_len(Table *t) { return t->n; }

static PyMethodDef Table_methods[] = {
    {"add", (PyCFunction)Table_add, METH_VARARGS, add_doc},
    {"get", (PyCFunction)Table_get, METH_O, get_doc},
    {"items", (PyCFunction)Table_items, METH_NOARGS, items_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Table_seq = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dsec_cli.push._known.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Table(k0, k1): chunk id -> (pack, offset, clen, ulen, codec), keyed by k0, k1",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_as_sequence = &Table_seq,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_known", "The chunks a store holds, as one compiled table.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__known(void) {
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
