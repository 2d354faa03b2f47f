/* Content-defined cut points with the GIL released.
 *
 * fastcdc's compiled chunker yields one Python object per chunk and holds the GIL for its
 * whole gear loop (about 0.8 s per GB here), so a build's compression workers, which give
 * the GIL back between groups, wait for it whenever the writer is cutting. This is the same
 * cut (FastCDC with normalized chunking as fastcdc 1.x computes it: one read window of
 * max(64 KiB, max_size) bytes per chunk, a small-chunk mask below the centre size and a
 * large-chunk mask after it) over a whole buffer, without the GIL, returning the chunk
 * lengths. The gear table is fastcdc's own, passed in by the caller (format/chunker.py),
 * and a test checks the two chunkers cut every input alike.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint32_t cdc_offset(const uint8_t *data, uint32_t size, uint32_t mi, uint32_t ma,
                           uint32_t cs, uint32_t mask_s, uint32_t mask_l,
                           const uint32_t *gear)
{
    uint32_t pattern = 0;
    uint32_t i = mi < size ? mi : size;
    uint32_t barrier = cs < size ? cs : size;
    for (; i < barrier; i++) {
        pattern = (pattern >> 1) + gear[data[i]];
        if (!(pattern & mask_s))
            return i + 1;
    }
    barrier = ma < size ? ma : size;
    for (; i < barrier; i++) {
        pattern = (pattern >> 1) + gear[data[i]];
        if (!(pattern & mask_l))
            return i + 1;
    }
    return i;
}

/* lengths(data, min_size, avg_size, max_size, gear) -> list[int] */
static PyObject *cdc_lengths(PyObject *self, PyObject *args)
{
    Py_buffer buf, gbuf;
    unsigned long mi, avg, ma;
    if (!PyArg_ParseTuple(args, "y*kkky*", &buf, &mi, &avg, &ma, &gbuf))
        return NULL;
    PyObject *out = NULL;
    uint32_t *lens = NULL;
    size_t n = 0;
    if (gbuf.len != 256 * sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ValueError, "the gear table must be 256 uint32 values");
        goto done;
    }
    if (mi < 64 || mi > (1UL << 26) || avg < 256 || avg > (1UL << 28) || ma < 1024 ||
        ma > (1UL << 30)) { /* fastcdc's bounds */
        PyErr_Format(PyExc_ValueError, "chunk sizes out of range: min %lu avg %lu max %lu",
                     mi, avg, ma);
        goto done;
    }
    /* fastcdc's parameters, derived as it derives them */
    uint32_t centre_from = (uint32_t)(mi + (mi + 1) / 2);
    if (centre_from > avg)
        centre_from = (uint32_t)avg;
    uint32_t cs = (uint32_t)avg - centre_from;
    if (cs > ma)
        cs = (uint32_t)ma;
    uint32_t bits = (uint32_t)lround(log2((double)avg));
    uint32_t mask_s = (uint32_t)((1ULL << (bits + 1)) - 1);
    uint32_t mask_l = (uint32_t)((1ULL << (bits - 1)) - 1);
    size_t window = ma > (64 << 10) ? ma : (64 << 10);
    const uint8_t *data = buf.buf;
    size_t size = (size_t)buf.len;
    size_t cap = size / mi + 2; /* every chunk but the last is at least min_size */
    lens = malloc(cap * sizeof(uint32_t));
    if (lens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t gear[256];
    memcpy(gear, gbuf.buf, sizeof(gear));
    Py_BEGIN_ALLOW_THREADS
    size_t off = 0;
    while (off < size && n < cap) {
        size_t left = size - off;
        uint32_t blob = (uint32_t)(left < window ? left : window);
        uint32_t cp = cdc_offset(data + off, blob, (uint32_t)mi, (uint32_t)ma, cs, mask_s,
                                 mask_l, gear);
        lens[n++] = cp;
        off += cp;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New((Py_ssize_t)n);
    if (out == NULL)
        goto done;
    for (size_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromUnsignedLong(lens[k]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, v);
    }
done:
    free(lens);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&gbuf);
    return out;
}

static PyMethodDef methods[] = {
    {"lengths", cdc_lengths, METH_VARARGS,
     "lengths(data, min_size, avg_size, max_size, gear) -> the content-defined chunk "
     "lengths of data, cut without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cdc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cdc(void) { return PyModule_Create(&module); }
