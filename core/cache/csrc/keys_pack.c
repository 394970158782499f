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

/* A buffer's item (`size` bytes, `sign`ed or not) at p: 1 with *out set when it is an int32,
 * else 0. Inlined in the loops, which the compiler then specialises per size. */
static inline int
item_int32(const char *p, Py_ssize_t size, int sign, int32_t *out)
{
    union {
        int8_t s8;
        uint8_t u8;
        int16_t s16;
        uint16_t u16;
        int32_t s32;
        uint32_t u32;
        int64_t s64;
        uint64_t u64;
    } x; /* every member at offset 0: copying `size` bytes sets that size's two */
    long long v;
    switch (size) {
    case 1:
        memcpy(&x, p, 1);
        v = sign ? (long long)x.s8 : (long long)x.u8;
        break;
    case 2:
        memcpy(&x, p, 2);
        v = sign ? (long long)x.s16 : (long long)x.u16;
        break;
    case 4:
        memcpy(&x, p, 4);
        v = sign ? (long long)x.s32 : (long long)x.u32;
        break;
    default:
        memcpy(&x, p, 8);
        if (!sign && x.u64 > INT32_MAX) {
            return 0;
        }
        v = (long long)x.s64;
        break;
    }
    *out = (int32_t)v;
    return v >= INT32_MIN && v <= INT32_MAX;
}

/* The error for token i, an item outside int32 (an int64, or an unsigned of 4 or 8 bytes),
 * as encode_tokens words it: -1. */
static int
outside_int32(const char *p, Py_ssize_t size, int sign, Py_ssize_t i)
{
    if (sign) {
        int64_t v;
        memcpy(&v, p, 8);
        PyErr_Format(kvf_invalid,
                     "tokens must be int32 token ids: token %zd is %lld, outside int32", i,
                     (long long)v);
        return -1;
    }
    uint32_t c = 0;
    uint64_t u = 0;
    if (size == 4) {
        memcpy(&c, p, 4);
        u = c;
    }
    else {
        memcpy(&u, p, 8);
    }
    PyErr_Format(kvf_invalid, "tokens must be int32 token ids: token %zd is %llu, outside int32",
                 i, (unsigned long long)u);
    return -1;
}

/* A view of a 1-D buffer of native integers (array('q'), a numpy array, bytes): 1, with
 * `sign` set; 0 with no error set when `tokens` is of another kind, which the caller then
 * iterates. */
static int
integer_view(PyObject *tokens, Py_buffer *view, int *sign)
{
    if (PyObject_GetBuffer(tokens, view, PyBUF_RECORDS_RO) != 0) {
        PyErr_Clear();
        return 0;
    }
    *sign = integer_format(view->format);
    Py_ssize_t size = view->itemsize;
    if (view->ndim != 1 || *sign < 0 || !(size == 1 || size == 2 || size == 4 || size == 8)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Whether a view is of int64s one after another, on a little-endian host: the layout token
 * arrays have (numpy's, array('q')'s), which the loops below read as 32-bit halves: an
 * int64 fits int32 when its high half is its low half's sign. So written, the compiler
 * vectorises them with SSE2 alone (it has no 64-bit compare before SSE4.1). */
static int
plain_int64(const Py_buffer *view, int sign)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return sign && view->itemsize == 8 && view->strides[0] == 8;
#else
    (void)view, (void)sign;
    return 0;
#endif
}

/* n plain int64s narrowed into out: 1 if every one fits int32 (else some of out is wrong,
 * and the caller reads them one by one). */
static int
narrow_int64(const char *p, Py_ssize_t n, char *out)
{
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t lo, hi;
        memcpy(&lo, p + 8 * i, 4);
        memcpy(&hi, p + 8 * i + 4, 4);
        bad |= hi ^ (uint32_t)((int32_t)lo >> 31);
        memcpy(out + 4 * i, &lo, 4);
    }
    return bad == 0;
}

/* Whether n plain int64s all fit int32 and equal raw's. */
static int
same_int64(const char *p, Py_ssize_t n, const char *raw)
{
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t lo, hi, want;
        memcpy(&lo, p + 8 * i, 4);
        memcpy(&hi, p + 8 * i + 4, 4);
        memcpy(&want, raw + 4 * i, 4);
        bad |= (hi ^ (uint32_t)((int32_t)lo >> 31)) | (lo ^ want);
    }
    return bad == 0;
}

/* A view's tokens packed into out, one by one: 0, or -1 with the error. */
static int
pack_view(const Py_buffer *view, int sign, char *out)
{
    const char *p = view->buf;
    for (Py_ssize_t i = 0; i < view->shape[0]; i++, p += view->strides[0]) {
        int32_t w;
        if (!item_int32(p, view->itemsize, sign, &w)) {
            return outside_int32(p, view->itemsize, sign, i);
        }
        memcpy(out + 4 * i, &w, 4);
    }
    return 0;
}

/* Whether a view's tokens equal raw's, one by one: 1, 0 at the first that differs (reading
 * no further), or -1 with the error for a token outside int32 read before. */
static int
equal_view(const Py_buffer *view, int sign, const char *raw)
{
    const char *p = view->buf;
    for (Py_ssize_t i = 0; i < view->shape[0]; i++, p += view->strides[0]) {
        int32_t w, want;
        if (!item_int32(p, view->itemsize, sign, &w)) {
            return outside_int32(p, view->itemsize, sign, i);
        }
        memcpy(&want, raw + 4 * i, 4);
        if (w != want) {
            return 0;
        }
    }
    return 1;
}

/* A 1-D buffer of native integers packed; NULL with no error set when the buffer is of
 * another kind (*other set), which the caller then iterates. */
static PyObject *
pack_buffer(PyObject *tokens, int *other)
{
    Py_buffer view;
    int sign;
    *other = !integer_view(tokens, &view, &sign);
    if (*other) {
        return NULL;
    }
    Py_ssize_t n = view.shape[0];
    PyObject *raw = new_raw(n);
    if (raw != NULL) {
        char *out = PyBytes_AS_STRING(raw);
        int packed = plain_int64(&view, sign) && narrow_int64(view.buf, n, out);
        if (!packed && pack_view(&view, sign, out) < 0) { /* else: which token, and why */
            Py_CLEAR(raw);
        }
    }
    PyBuffer_Release(&view);
    return raw;
}

/* Whether a 1-D integer buffer's tokens pack to `raw`, compared in place: 1, 0 (at the first
 * that differs, reading no further), -1 with an error (a token outside int32 read before
 * one differed), or -2 with no error when `tokens` is not such a buffer. */
static int
equal_buffer(PyObject *tokens, PyObject *raw)
{
    Py_buffer view;
    int sign;
    if (!integer_view(tokens, &view, &sign)) {
        return -2;
    }
    Py_ssize_t n = view.shape[0];
    Py_ssize_t len = PyBytes_GET_SIZE(raw); /* n may be any size (a broadcast view): no 4 * n */
    const char *at = PyBytes_AS_STRING(raw);
    int same = len % 4 == 0 && n == len / 4;
    if (same && !(plain_int64(&view, sign) && same_int64(view.buf, n, at))) {
        same = equal_view(&view, sign, at); /* which differs first, or is outside int32 */
    }
    PyBuffer_Release(&view);
    return same;
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
    else if (PyObject_CheckBuffer(tokens)) {
        int same = equal_buffer(tokens, raw);
        if (same != -2) {
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
