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

/* The gear hash forgets: after a few dozen steps its value no longer depends on where it
 * started (each step halves what came before). So a range can be scanned as two lanes at
 * once, the second half started "warm" a little before its first byte, and the two
 * independent shift-and-add chains keep the core busy where one chain waits on its own
 * latency. The second lane's result is used only once the first lane has reached it
 * exactly and found the same hash there; in the rare case the warm start differs, that
 * half is scanned again from the exact hash. The cut points are those of the sequential
 * scan, always. */
#define WARM 64u /* steps a lane is started before its first byte (at most) */
#define LANE_MAX 8192u

/* the first i in [i, end) where (h & mask) == 0 after byte i, or -1; *h is the hash after
 * the last byte scanned */
static int64_t scan1(const uint8_t *d, uint32_t i, uint32_t end, uint32_t *h, uint32_t mask,
                     const uint32_t *gear)
{
    uint32_t x = *h;
    for (; i < end; i++) {
        x = (x >> 1) + gear[d[i]];
        if (!(x & mask)) {
            *h = x;
            return i;
        }
    }
    *h = x;
    return -1;
}

static int64_t scan2(const uint8_t *d, uint32_t i, uint32_t end, uint32_t *h, uint32_t mask,
                     const uint32_t *gear, uint32_t warm)
{
    uint32_t x = *h;
    while (end - i >= 2 * WARM + 64) {
        uint32_t lane = (end - i) / 2;
        if (lane > LANE_MAX)
            lane = LANE_MAX;
        uint32_t b = i + lane, j;
        uint32_t y = 0;
        for (j = b - warm; j < b; j++)
            y = (y >> 1) + gear[d[j]];
        uint32_t y0 = y;
        int64_t hit_b = -1;
        for (j = 0; j < lane; j++) {
            x = (x >> 1) + gear[d[i + j]];
            y = (y >> 1) + gear[d[b + j]];
            if (!(x & mask)) {
                *h = x;
                return i + j;
            }
            if (!(y & mask)) {
                hit_b = b + j;
                j++;
                break;
            }
        }
        /* the first lane alone, to the end of its half */
        for (; j < lane; j++) {
            x = (x >> 1) + gear[d[i + j]];
            if (!(x & mask)) {
                *h = x;
                return i + j;
            }
        }
        if (x != y0) { /* the warm start differs from the exact hash: scan again */
            int64_t r = scan1(d, b, b + lane, &x, mask, gear);
            if (r >= 0) {
                *h = x;
                return r;
            }
        } else if (hit_b >= 0) {
            *h = y;
            return hit_b;
        } else {
            x = y;
        }
        i = b + lane;
    }
    *h = x;
    return scan1(d, i, end, h, mask, gear);
}

static uint32_t cdc_offset(const uint8_t *data, uint32_t size, uint32_t mi, uint32_t ma,
                           uint32_t cs, uint32_t mask_s, uint32_t mask_l,
                           const uint32_t *gear, uint32_t warm)
{
    uint32_t pattern = 0;
    uint32_t i = mi < size ? mi : size;
    uint32_t barrier = cs < size ? cs : size;
    int64_t r;
    if (i < barrier) {
        r = scan2(data, i, barrier, &pattern, mask_s, gear, warm);
        if (r >= 0)
            return (uint32_t)r + 1;
        i = barrier;
    }
    barrier = ma < size ? ma : size;
    if (i < barrier) {
        r = scan2(data, i, barrier, &pattern, mask_l, gear, warm);
        if (r >= 0)
            return (uint32_t)r + 1;
        i = barrier;
    }
    return i;
}

/* lengths(data, min_size, avg_size, max_size, gear[, warm]) -> list[int]; warm (1 to 64,
 * default 64) is there for tests: a short warm start makes the second lane's hash differ
 * from the exact one, and the cut points must not change */
static PyObject *cdc_lengths(PyObject *self, PyObject *args)
{
    Py_buffer buf, gbuf;
    unsigned long mi, avg, ma, warm = WARM;
    if (!PyArg_ParseTuple(args, "y*kkky*|k", &buf, &mi, &avg, &ma, &gbuf, &warm))
        return NULL;
    PyObject *out = NULL;
    uint32_t *lens = NULL;
    size_t n = 0;
    if (gbuf.len != 256 * sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ValueError, "the gear table must be 256 uint32 values");
        goto done;
    }
    if (warm < 1 || warm > WARM) {
        PyErr_Format(PyExc_ValueError, "warm must be 1 to %u", WARM);
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
                                 mask_l, gear, (uint32_t)warm);
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
     "lengths(data, min_size, avg_size, max_size, gear[, warm]) -> the content-defined "
     "chunk lengths of data, cut without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cdc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cdc(void) { return PyModule_Create(&module); }
