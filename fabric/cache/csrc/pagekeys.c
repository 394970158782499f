/* kvfabric.fabric.cache._pagekeys: the native path of fabric/cache/keys.py.
 *
 * pack(tokens) -> bytes: token ids as native int32, as struct.pack("{n}i", *tokens).
 * pack_keys(tokens, key, prev, first_page, page_size) -> (bytes, [key, ...]): the same
 *     bytes and the chained key of every whole page from first_page on.
 * chain(raw, key, prev, first_page, page_size) -> [key, ...]: keys of packed tokens.
 * blake2b(data, key, digest_size) -> bytes: the hash itself, for tests.
 *
 * Page key i is keyed BLAKE2b-128 of (key i-1 || the page's int32 bytes); key -1 is prev.
 * Every input is checked before anything is built; bad input raises the error type
 * keys.py registers with set_error (its KeyError_), with the messages the Python
 * reference gives, so the two paths agree on errors as well as on bytes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "blake2b.h"

#define KEY_BYTES 16
#define MAX_PAGE_SIZE (1 << 20)

static PyObject *Invalid;   /* the error type bad input raises (set_error), ValueError until then */

/* ---- packing ------------------------------------------------------------------------- */

static int type_error_at(Py_ssize_t i, PyObject *item) {
    PyErr_Format(Invalid, "tokens must be int32 token ids: token %zd is %R, not an int", i, item);
    return -1;
}

static int range_error_at(Py_ssize_t i, PyObject *value) {
    PyErr_Format(Invalid, "tokens must be int32 token ids: token %zd is %S, outside int32", i, value);
    return -1;
}

/* Packs items[0..n) into out. Returns 0, -1 with an error set, or 1 when an item is not
 * an exact int and index is 0: converting it runs Python code, which may change a list
 * under us, so the caller retries over a snapshot with index 1. */
static int pack_items(PyObject *const *items, Py_ssize_t n, char *out, int index) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        int overflow;
        long long v;
        if (PyLong_CheckExact(item)) {
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || v < INT32_MIN || v > INT32_MAX)
                return range_error_at(i, item);
        } else {
            if (!index)
                return 1;
            PyObject *ix = PyNumber_Index(item);
            if (ix == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError))
                    return -1;      /* __index__ itself failed: its error, as struct gives it */
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
static PyObject *new_raw(Py_ssize_t n) {
    if (n > PY_SSIZE_T_MAX / 4)
        return PyErr_NoMemory();
    return PyBytes_FromStringAndSize(NULL, 4 * n);
}

static PyObject *pack_tuple(PyObject *tuple) {
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    PyObject *raw = new_raw(n);
    if (raw == NULL)
        return NULL;
    if (pack_items(PySequence_Fast_ITEMS(tuple), n, PyBytes_AS_STRING(raw), 1) != 0) {
        Py_DECREF(raw);
        return NULL;
    }
    return raw;
}

static PyObject *pack_list(PyObject *list) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *raw = new_raw(n);
    if (raw == NULL)
        return NULL;
    int rc = pack_items(PySequence_Fast_ITEMS(list), n, PyBytes_AS_STRING(raw), 0);
    if (rc == 0)
        return raw;
    Py_DECREF(raw);
    if (rc < 0)
        return NULL;
    PyObject *snapshot = PyList_AsTuple(list);
    if (snapshot == NULL)
        return NULL;
    raw = pack_tuple(snapshot);
    Py_DECREF(snapshot);
    return raw;
}

/* Whether a buffer format is one native integer ('@' optional): 1 signed, 0 unsigned, -1 not. */
static int integer_format(const char *fmt) {
    if (fmt == NULL)
        return 0;           /* no format means unsigned bytes */
    if (fmt[0] == '@')
        fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0')
        return -1;
    switch (fmt[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
        return 1;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
        return 0;
    default:
        return -1;
    }
}

/* A 1-D buffer of native integers (array('q'), a numpy array, bytes); NULL with no error
 * set when the buffer is of another kind, which the caller then iterates. */
static PyObject *pack_buffer(PyObject *tokens, int *other) {
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
            int8_t a; int16_t b; int32_t c; int64_t d;
            switch (size) {
            case 1: memcpy(&a, p, 1); v = a; break;
            case 2: memcpy(&b, p, 2); v = b; break;
            case 4: memcpy(&c, p, 4); v = c; break;
            default: memcpy(&d, p, 8); v = d; break;
            }
            if (v < INT32_MIN || v > INT32_MAX) {
                PyErr_Format(Invalid, "tokens must be int32 token ids: token %zd is %lld, outside int32", i, v);
                goto fail;
            }
        } else {
            uint8_t a; uint16_t b; uint32_t c; uint64_t d;
            switch (size) {
            case 1: memcpy(&a, p, 1); u = a; break;
            case 2: memcpy(&b, p, 2); u = b; break;
            case 4: memcpy(&c, p, 4); u = c; break;
            default: memcpy(&d, p, 8); u = d; break;
            }
            if (u > INT32_MAX) {
                PyErr_Format(Invalid, "tokens must be int32 token ids: token %zd is %llu, outside int32", i, u);
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
static PyObject *pack_iterable(PyObject *tokens) {
    Py_ssize_t n = PyObject_Size(tokens);
    if (n < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear();
        PyObject *name = PyType_GetName(Py_TYPE(tokens));
        if (name != NULL) {
            PyErr_Format(Invalid, "tokens must be a sequence of int32 token ids, got %U", name);
            Py_DECREF(name);
        }
        return NULL;
    }
    PyObject *snapshot = PySequence_Tuple(tokens);
    if (snapshot == NULL)
        return NULL;
    PyObject *raw = NULL;
    if (PyTuple_GET_SIZE(snapshot) != n)
        PyErr_Format(Invalid, "tokens must be int32 token ids: their length changed while packing");
    else
        raw = pack_tuple(snapshot);
    Py_DECREF(snapshot);
    return raw;
}

static PyObject *pack_any(PyObject *tokens) {
    if (PyList_CheckExact(tokens))
        return pack_list(tokens);
    if (PyTuple_CheckExact(tokens))
        return pack_tuple(tokens);
    if (PyObject_CheckBuffer(tokens)) {
        int other;
        PyObject *raw = pack_buffer(tokens, &other);
        if (raw != NULL || !other)
            return raw;
    }
    return pack_iterable(tokens);
}

/* ---- chained keys -------------------------------------------------------------------- */

typedef struct {
    kvf_blake2b base;           /* keyed, the key block already compressed */
    uint8_t prev[KEY_BYTES];
    long long first_page;
    Py_ssize_t page_bytes;
} Chain;

static int parse_chain(PyObject *const *args, Chain *c) {
    PyObject *key = args[0], *prev = args[1], *first = args[2], *page = args[3];
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 1 || PyBytes_GET_SIZE(key) > KVF_BLAKE2B_MAX_KEY) {
        PyErr_Format(Invalid, "key must be 1 to %d bytes, got %R", KVF_BLAKE2B_MAX_KEY, key);
        return -1;
    }
    if (!PyBytes_Check(prev) || PyBytes_GET_SIZE(prev) != KEY_BYTES) {
        PyErr_Format(Invalid, "prev must be a %d-byte page key, got %R", KEY_BYTES, prev);
        return -1;
    }
    int overflow = 0;
    c->first_page = PyLong_Check(first) ? PyLong_AsLongLongAndOverflow(first, &overflow) : -1;
    if (overflow > 0)
        c->first_page = LLONG_MAX;      /* past any page: no keys */
    else if (c->first_page < 0 || overflow < 0) {
        PyErr_Format(Invalid, "first_page must be an int >= 0, got %R", first);
        return -1;
    }
    long long size = PyLong_Check(page) && !PyBool_Check(page) ? PyLong_AsLongLongAndOverflow(page, &overflow) : -1;
    if (size < 1 || size > MAX_PAGE_SIZE || overflow) {
        PyErr_Format(Invalid, "page_size must be an int from 1 to %d, got %R", MAX_PAGE_SIZE, page);
        return -1;
    }
    c->page_bytes = (Py_ssize_t)size * 4;
    memcpy(c->prev, PyBytes_AS_STRING(prev), KEY_BYTES);
    kvf_blake2b_init(&c->base, KEY_BYTES, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
    kvf_blake2b_settle(&c->base);
    return 0;
}

static PyObject *chain_keys(const Chain *c, const char *raw, Py_ssize_t len) {
    long long pages = len / c->page_bytes;
    Py_ssize_t count = c->first_page < pages ? (Py_ssize_t)(pages - c->first_page) : 0;
    PyObject *keys = PyList_New(count);
    if (keys == NULL)
        return NULL;
    uint8_t prev[KEY_BYTES];
    memcpy(prev, c->prev, KEY_BYTES);
    const char *page = raw + (count ? c->first_page * c->page_bytes : 0);
    for (Py_ssize_t j = 0; j < count; j++, page += c->page_bytes) {
        kvf_blake2b s = c->base;
        kvf_blake2b_update(&s, prev, KEY_BYTES);
        kvf_blake2b_update(&s, page, (size_t)c->page_bytes);
        kvf_blake2b_final(&s, prev);
        PyObject *k = PyBytes_FromStringAndSize((const char *)prev, KEY_BYTES);
        if (k == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, j, k);
    }
    return keys;
}

/* ---- module functions ---------------------------------------------------------------- */

static int nargs_is(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

static PyObject *py_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_is("pack", nargs, 1))
        return NULL;
    return pack_any(args[0]);
}

static PyObject *py_pack_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Chain c;
    if (!nargs_is("pack_keys", nargs, 5) || parse_chain(args + 1, &c) != 0)
        return NULL;
    PyObject *raw = pack_any(args[0]);
    if (raw == NULL)
        return NULL;
    PyObject *keys = chain_keys(&c, PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw));
    if (keys == NULL) {
        Py_DECREF(raw);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, raw, keys);
    Py_DECREF(raw);
    Py_DECREF(keys);
    return out;
}

static int raw_view(PyObject *raw, Py_buffer *view) {
    if (PyObject_GetBuffer(raw, view, PyBUF_SIMPLE) == 0)
        return 0;
    PyErr_Clear();
    PyObject *name = PyType_GetName(Py_TYPE(raw));
    if (name != NULL) {
        PyErr_Format(Invalid, "raw must be a contiguous bytes-like object, got %U", name);
        Py_DECREF(name);
    }
    return -1;
}

static PyObject *py_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Chain c;
    Py_buffer view;
    if (!nargs_is("chain", nargs, 5) || parse_chain(args + 1, &c) != 0 || raw_view(args[0], &view) != 0)
        return NULL;
    PyObject *keys = chain_keys(&c, view.buf, view.len);
    PyBuffer_Release(&view);
    return keys;
}

static PyObject *py_blake2b(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_is("blake2b", nargs, 3))
        return NULL;
    PyObject *key = args[1];
    Py_ssize_t size = PyLong_Check(args[2]) ? PyLong_AsSsize_t(args[2]) : -1;
    if (size == -1 && PyErr_Occurred())
        PyErr_Clear();
    if (size < 1 || size > KVF_BLAKE2B_MAX_OUT) {
        PyErr_Format(PyExc_ValueError, "digest_size must be 1 to %d, got %R", KVF_BLAKE2B_MAX_OUT, args[2]);
        return NULL;
    }
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > KVF_BLAKE2B_MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "key must be at most %d bytes, got %R", KVF_BLAKE2B_MAX_KEY, key);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0)
        return NULL;
    kvf_blake2b s;
    uint8_t out[KVF_BLAKE2B_MAX_OUT];
    kvf_blake2b_init(&s, (size_t)size, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
    kvf_blake2b_update(&s, view.buf, (size_t)view.len);
    kvf_blake2b_final(&s, out);
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)out, size);
}

static PyObject *py_set_error(PyObject *self, PyObject *cls) {
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        PyErr_Format(PyExc_TypeError, "set_error takes an Exception subclass, got %R", cls);
        return NULL;
    }
    Py_INCREF(cls);
    Py_SETREF(Invalid, cls);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_FASTCALL, "pack(tokens) -> int32 bytes"},
    {"pack_keys", (PyCFunction)(void (*)(void))py_pack_keys, METH_FASTCALL,
     "pack_keys(tokens, key, prev, first_page, page_size) -> (bytes, keys)"},
    {"chain", (PyCFunction)(void (*)(void))py_chain, METH_FASTCALL,
     "chain(raw, key, prev, first_page, page_size) -> keys"},
    {"blake2b", (PyCFunction)(void (*)(void))py_blake2b, METH_FASTCALL,
     "blake2b(data, key, digest_size) -> digest"},
    {"set_error", py_set_error, METH_O, "set_error(cls): the error type bad input raises"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pagekeys", "Chained BLAKE2b page keys (see fabric/cache/keys.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__pagekeys(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Invalid = Py_NewRef(PyExc_ValueError);
    if (PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PAGE_SIZE", MAX_PAGE_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
