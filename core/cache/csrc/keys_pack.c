/* Packing token ids as native int32, as struct.pack("{n}i", *tokens) does, with the
 * errors of keys.py's reference (the first bad token, by position). Lists and tuples of
 * exact ints and 1-D integer buffers take the fast paths; anything else is iterated. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "keys_pack.h"

static int
type_error_at(Py_ssize_t i, PyObject *item)
{
    PyErr_Format(kvf_invalid, "tokens must be int32 token ids: token %zd is %R, not an int", i,
                 item);
    return -1;
}

static int
range_error_at(Py_ssize_t i, PyObject *value)
{
    PyErr_Format(kvf_invalid, "tokens must be int32 token ids: token %zd is %S, outside int32", i,
                 value);
    return -1;
}

/* An exact int's value without a call, where it is one machine digit or less (every
 * token id is): 1 with *v set, or 0 for the general path. */
static inline int
small_value(PyObject *item, long long *v)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        return 0;
    }
    *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size < -1 || size > 1) {
        return 0;
    }
    *v = size * (long long)((PyLongObject *)item)->ob_digit[0];
    return 1;
#endif
}

/* Packs items[0..n) into out. Returns 0, -1 with an error set, or 1 when an item is not
 * an exact int and index is 0: converting it runs Python code, which may change a list
 * under us, so the caller retries over a snapshot with index 1. */
static int
pack_items(PyObject *const *items, Py_ssize_t n, char *out, int index)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        int overflow;
        long long v;
        if (PyLong_CheckExact(item) && small_value(item, &v)) {
            if (v < INT32_MIN || v > INT32_MAX) {
                return range_error_at(i, item);
            }
        }
        else if (PyLong_CheckExact(item)) {
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || v < INT32_MIN || v > INT32_MAX) {
                return range_error_at(i, item);
            }
        }
        else {
            if (!index) {
                return 1;
            }
            PyObject *ix = PyNumber_Index(item);
            if (ix == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                    return -1; /* __index__ itself failed: its error, as struct gives it */
                }
                PyErr_Clear();
                return type_error_at(i, item);
            }
            v = PyLong_AsLongLongAndOverflow(ix, &overflow);
            if (overflow || v < INT32_MIN || v > INT32_MAX) {
                range_error_at(i, ix);
                Py_DECREF(ix);
                return -1;
            }
            Py_DECREF(ix);
        }
        int32_t w = (int32_t)v;
        memcpy(out + 4 * i, &w, 4);
    }
    return 0;
}

/* Room for n packed tokens (a buffer's length can be anything: a broadcast view has no
 * memory behind it). */
static PyObject *
new_raw(Py_ssize_t n)
{
    if (n > PY_SSIZE_T_MAX / 4) {
        return PyErr_NoMemory();
    }
    return PyBytes_FromStringAndSize(NULL, 4 * n);
}

static PyObject *
pack_tuple(PyObject *tuple)
{
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    PyObject *raw = new_raw(n);
    if (raw == NULL) {
        return NULL;
    }
    if (pack_items(PySequence_Fast_ITEMS(tuple), n, PyBytes_AS_STRING(raw), 1) != 0) {
        Py_DECREF(raw);
        return NULL;
    }
    return raw;
}

static PyObject *
pack_list(PyObject *list)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *raw = new_raw(n);
    if (raw == NULL) {
        return NULL;
    }
    int rc = pack_items(PySequence_Fast_ITEMS(list), n, PyBytes_AS_STRING(raw), 0);
    if (rc == 0) {
        return raw;
    }
    Py_DECREF(raw);
    if (rc < 0) {
        return NULL;
    }
    PyObject *snapshot = PyList_AsTuple(list);
    if (snapshot == NULL) {
        return NULL;
    }
    raw = pack_tuple(snapshot);
    Py_DECREF(snapshot);
    return raw;
}

/* Whether a buffer format is one native integer ('@' optional): 1 signed, 0 unsigned, -1 not. */
static int
integer_format(const char *fmt)
{
    if (fmt == NULL) {
        return 0; /* no format means unsigned bytes */
    }
    if (fmt[0] == '@') {
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0') {
        return -1;
    }
    switch (fmt[0]) {
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
    case 'n':
        return 1;
    case 'B':
    case 'H':
    case 'I':
    case 'L':
    case 'Q':
    case 'N':
        return 0;
    default:
        return -1;
    }
}

/* A 1-D buffer of native integers (array('q'), a numpy array, bytes); NULL with no error
 * set when the buffer is of another kind, which the caller then iterates. */
static PyObject *
pack_buffer(PyObject *tokens, int *other)
{
    Py_buffer view;
    *other = 1;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_RECORDS_RO) != 0) {
        PyErr_Clear();
        return NULL;
    }
    int sign = integer_format(view.format);
    Py_ssize_t size = view.itemsize;
    if (view.ndim != 1 || sign < 0 || !(size == 1 || size == 2 || size == 4 || size == 8)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    *other = 0;
    Py_ssize_t n = view.shape[0], stride = view.strides[0];
    PyObject *raw = new_raw(n);
    if (raw == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(raw);
    const char *p = view.buf;
    for (Py_ssize_t i = 0; i < n; i++, p += stride) {
        long long v = 0;
        unsigned long long u = 0;
        if (sign) {
            int8_t a;
            int16_t b;
            int32_t c;
            int64_t d;
            switch (size) {
            case 1:
                memcpy(&a, p, 1);
                v = a;
                break;
            case 2:
                memcpy(&b, p, 2);
                v = b;
                break;
            case 4:
                memcpy(&c, p, 4);
                v = c;
                break;
            default:
                memcpy(&d, p, 8);
                v = d;
                break;
            }
            if (v < INT32_MIN || v > INT32_MAX) {
                PyErr_Format(kvf_invalid,
                             "tokens must be int32 token ids: token %zd is %lld, outside int32", i,
                             v);
                goto fail;
            }
        }
        else {
            uint8_t a;
            uint16_t b;
            uint32_t c;
            uint64_t d;
            switch (size) {
            case 1:
                memcpy(&a, p, 1);
                u = a;
                break;
            case 2:
                memcpy(&b, p, 2);
                u = b;
                break;
            case 4:
                memcpy(&c, p, 4);
                u = c;
                break;
            default:
                memcpy(&d, p, 8);
                u = d;
                break;
            }
            if (u > INT32_MAX) {
                PyErr_Format(kvf_invalid,
                             "tokens must be int32 token ids: token %zd is %llu, outside int32", i,
                             u);
                goto fail;
            }
            v = (long long)u;
        }
        int32_t w = (int32_t)v;
        memcpy(out + 4 * i, &w, 4);
    }
    PyBuffer_Release(&view);
    return raw;
fail:
    PyBuffer_Release(&view);
    Py_DECREF(raw);
    return NULL;
}

/* Any other sized iterable: its items, snapshotted, as struct.pack(*tokens) takes them. */
static PyObject *
pack_iterable(PyObject *tokens)
{
    Py_ssize_t n = PyObject_Size(tokens);
    if (n < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            return NULL;
        }
        PyErr_Clear();
        PyObject *name = PyType_GetName(Py_TYPE(tokens));
        if (name != NULL) {
            PyErr_Format(kvf_invalid, "tokens must be a sequence of int32 token ids, got %U",
                         name);
            Py_DECREF(name);
        }
        return NULL;
    }
    PyObject *snapshot = PySequence_Tuple(tokens);
    if (snapshot == NULL) {
        return NULL;
    }
    PyObject *raw = NULL;
    if (PyTuple_GET_SIZE(snapshot) != n) {
        PyErr_Format(kvf_invalid,
                     "tokens must be int32 token ids: their length changed while packing");
    }
    else {
        raw = pack_tuple(snapshot);
    }
    Py_DECREF(snapshot);
    return raw;
}

PyObject *
kvf_pack(PyObject *tokens)
{
    if (PyList_CheckExact(tokens)) {
        return pack_list(tokens);
    }
    if (PyTuple_CheckExact(tokens)) {
        return pack_tuple(tokens);
    }
    if (PyObject_CheckBuffer(tokens)) {
        int other;
        PyObject *raw = pack_buffer(tokens, &other);
        if (raw != NULL || !other) {
            return raw;
        }
    }
    return pack_iterable(tokens);
}

/* Whether items[0..n) are exact ints equal to the int32s at raw: 1, 0, or -1 when an item
 * needs the general path (not an exact small int). */
static int
equal_items(PyObject *const *items, Py_ssize_t n, const char *raw)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        if (!PyLong_CheckExact(items[i]) || !small_value(items[i], &v)) {
            return -1;
        }
        int32_t w;
        memcpy(&w, raw + 4 * i, 4);
        if (v != w) {
            return 0;
        }
    }
    return 1;
}

int
kvf_equal(PyObject *tokens, PyObject *raw)
{
    if (!PyBytes_Check(raw)) {
        PyErr_SetString(PyExc_TypeError, "raw must be bytes");
        return -1;
    }
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
        if (4 * n != PyBytes_GET_SIZE(raw)) {
            return 0;
        }
        int same = equal_items(PySequence_Fast_ITEMS(tokens), n, PyBytes_AS_STRING(raw));
        if (same >= 0) {
            return same;
        }
    }
    PyObject *packed = kvf_pack(tokens); /* anything else: what packing it gives */
    if (packed == NULL) {
        return -1;
    }
    int same =
        PyBytes_GET_SIZE(packed) == PyBytes_GET_SIZE(raw) &&
        memcmp(PyBytes_AS_STRING(packed), PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw)) == 0;
    Py_DECREF(packed);
    return same;
}
