/* The compiled half of reading a tar header block (build/tarhdr.py): the checksum and the
 * fields of one 512-byte ustar/GNU/pax header, decoded in one call instead of tarfile's
 * dozen slices, string searches and int() parses per member.
 *
 * It only answers for the plain form of each field (octal digits between spaces, names up
 * to their NUL); anything else (base-256 numbers, other whitespace, signs, an all-zero or
 * short block, a bad checksum, the old GNU sparse header) gets None, and tarfile's own
 * parser reads that block, so every header reads exactly as tarfile reads it, errors
 * included.
 *
 * Built by scripts/setup.sh with gcc and the Python headers; where it is not built,
 * tarfile's parser reads every block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#define BLOCK 512

/* A number field in its plain form: spaces, octal digits, spaces, then NUL or the field's
 * end. 1 with the value in *out; 0 for any other form (tarfile then reads the block). */
static int plain_octal(const unsigned char *f, int len, long long *out) {
    int i = 0;
    long long n = 0;
    int digits = 0;
    if (len > 0 && (f[0] == 0x80 || f[0] == 0xff))
        return 0; /* base-256 */
    while (i < len && f[i] == ' ')
        i++;
    while (i < len && f[i] >= '0' && f[i] <= '7') {
        if (++digits > 20)
            return 0;
        n = n * 8 + (f[i] - '0');
        i++;
    }
    while (i < len && f[i] == ' ')
        i++;
    if (i < len && f[i] != 0)
        return 0;
    *out = n;
    return 1;
}

/* The bytes up to the first NUL, decoded as tarfile decodes names */
static PyObject *nts(const unsigned char *f, int len, const char *encoding,
                     const char *errors) {
    const unsigned char *nul = memchr(f, 0, (size_t)len);
    Py_ssize_t n = nul ? (Py_ssize_t)(nul - f) : len;
    return PyUnicode_Decode((const char *)f, n, encoding, errors);
}

static PyObject *header(PyObject *self, PyObject *args) {
    Py_buffer view;
    const char *encoding, *errors;
    if (!PyArg_ParseTuple(args, "y*ss", &view, &encoding, &errors))
        return NULL;
    PyObject *result = NULL;
    const unsigned char *b = view.buf;
    long long chk, mode, uid, gid, size, mtime, major, minor;
    unsigned long usum = 256;
    long ssum = 256;
    int i, zero = 1;

    if (view.len != BLOCK)
        goto fallback;
    for (i = 0; i < BLOCK; i++) {
        if (b[i])
            zero = 0;
        if (i >= 148 && i < 156)
            continue;
        usum += b[i];
        ssum += (signed char)b[i];
    }
    if (zero || b[156] == 'S') /* the end, or the old GNU sparse header */
        goto fallback;
    if (!plain_octal(b + 148, 8, &chk) || (chk != (long long)usum && chk != (long long)ssum))
        goto fallback;
    if (!plain_octal(b + 100, 8, &mode) || !plain_octal(b + 108, 8, &uid) ||
        !plain_octal(b + 116, 8, &gid) || !plain_octal(b + 124, 12, &size) ||
        !plain_octal(b + 136, 12, &mtime) || !plain_octal(b + 329, 8, &major) ||
        !plain_octal(b + 337, 8, &minor))
        goto fallback;
    {
        PyObject *name = nts(b, 100, encoding, errors);
        PyObject *link = name ? nts(b + 157, 100, encoding, errors) : NULL;
        PyObject *uname = link ? nts(b + 265, 32, encoding, errors) : NULL;
        PyObject *gname = uname ? nts(b + 297, 32, encoding, errors) : NULL;
        PyObject *prefix = gname ? nts(b + 345, 155, encoding, errors) : NULL;
        if (prefix)
            result = Py_BuildValue("(NLLLLLLy#NNNLLN)", name, mode, uid, gid, size, mtime,
                                   chk, (const char *)b + 156, (Py_ssize_t)1, link, uname,
                                   gname, major, minor, prefix);
        else { /* a name tarfile cannot decode either: it reads the block, and raises */
            PyErr_Clear();
            Py_XDECREF(name);
            Py_XDECREF(link);
            Py_XDECREF(uname);
            Py_XDECREF(gname);
        }
    }
    PyBuffer_Release(&view);
    if (result == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
fallback:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS,
     "header(block, encoding, errors) -> (name, mode, uid, gid, size, mtime, chksum, type, "
     "linkname, uname, gname, devmajor, devminor, prefix), or None where tarfile must read "
     "the block itself"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tarhdr", "Tar header blocks decoded in one call.", -1, methods,
};

PyMODINIT_FUNC PyInit__tarhdr(void) { return PyModule_Create(&module); }
