/* kvfabric.core.cache._pagekeys: the native path of core/cache/keys.py.
 *
 * pack(tokens) -> bytes: token ids as native int32, as struct.pack("{n}i", *tokens).
 * equal(tokens, raw) -> bool: pack(tokens) == raw, for lists of small ints without packing.
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
#include "keys_pack.h"

#define KEY_BYTES     16
#define MAX_PAGE_SIZE (1 << 20)

PyObject *kvf_invalid; /* see keys_pack.h; ValueError until set_error */

/* ---- chained keys -------------------------------------------------------------------- */

typedef struct {
    kvf_blake2b base; /* keyed, the key block already compressed */
    uint8_t prev[KEY_BYTES];
    long long first_page;
    Py_ssize_t page_bytes;
} Chain;

/* The keyed state of `key`, its key block compressed. The last key's is kept: requests come
 * in runs of one namespace, and compressing the key block again would cost a page key a
 * call. (Module state shared by every call: the GIL orders them.) */
static void
keyed_state(const char *key, Py_ssize_t len, kvf_blake2b *out)
{
    static kvf_blake2b last;
    static char last_key[KVF_BLAKE2B_MAX_KEY];
    static Py_ssize_t last_len = 0; /* 0: none kept (keys are 1 byte or more) */
    if (len != last_len || memcmp(key, last_key, (size_t)len) != 0) {
        kvf_blake2b_init(&last, KEY_BYTES, key, (size_t)len);
        kvf_blake2b_settle(&last);
        memcpy(last_key, key, (size_t)len);
        last_len = len;
    }
    *out = last;
}

static int
parse_chain(PyObject *const *args, Chain *c)
{
    PyObject *key = args[0], *prev = args[1], *first = args[2], *page = args[3];
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 1 ||
        PyBytes_GET_SIZE(key) > KVF_BLAKE2B_MAX_KEY) {
        PyErr_Format(kvf_invalid, "key must be 1 to %d bytes, got %R", KVF_BLAKE2B_MAX_KEY, key);
        return -1;
    }
    if (!PyBytes_Check(prev) || PyBytes_GET_SIZE(prev) != KEY_BYTES) {
        PyErr_Format(kvf_invalid, "prev must be a %d-byte page key, got %R", KEY_BYTES, prev);
        return -1;
    }
    int overflow = 0;
    c->first_page = PyLong_Check(first) ? PyLong_AsLongLongAndOverflow(first, &overflow) : -1;
    if (overflow > 0) {
        c->first_page = LLONG_MAX; /* past any page: no keys */
    }
    else if (c->first_page < 0 || overflow < 0) {
        PyErr_Format(kvf_invalid, "first_page must be an int >= 0, got %R", first);
        return -1;
    }
    long long size = PyLong_Check(page) && !PyBool_Check(page)
                         ? PyLong_AsLongLongAndOverflow(page, &overflow)
                         : -1;
    if (size < 1 || size > MAX_PAGE_SIZE || overflow) {
        PyErr_Format(kvf_invalid, "page_size must be an int from 1 to %d, got %R", MAX_PAGE_SIZE,
                     page);
        return -1;
    }
    c->page_bytes = (Py_ssize_t)size * 4;
    memcpy(c->prev, PyBytes_AS_STRING(prev), KEY_BYTES);
    keyed_state(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), &c->base);
    return 0;
}

static PyObject *
chain_keys(const Chain *c, const char *raw, Py_ssize_t len)
{
    long long pages = len / c->page_bytes;
    Py_ssize_t count = c->first_page < pages ? (Py_ssize_t)(pages - c->first_page) : 0;
    PyObject *keys = PyList_New(count);
    if (keys == NULL) {
        return NULL;
    }
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

static int
nargs_is(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

static PyObject *
py_pack(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_is("pack", nargs, 1)) {
        return NULL;
    }
    return kvf_pack(args[0]);
}

static PyObject *
py_equal(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_is("equal", nargs, 2)) {
        return NULL;
    }
    int same = kvf_equal(args[0], args[1]);
    return same < 0 ? NULL : PyBool_FromLong(same);
}

static PyObject *
py_pack_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    Chain c;
    if (!nargs_is("pack_keys", nargs, 5) || parse_chain(args + 1, &c) != 0) {
        return NULL;
    }
    PyObject *raw = kvf_pack(args[0]);
    if (raw == NULL) {
        return NULL;
    }
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

static int
raw_view(PyObject *raw, Py_buffer *view)
{
    if (PyObject_GetBuffer(raw, view, PyBUF_SIMPLE) == 0) {
        return 0;
    }
    PyErr_Clear();
    PyObject *name = PyType_GetName(Py_TYPE(raw));
    if (name != NULL) {
        PyErr_Format(kvf_invalid, "raw must be a contiguous bytes-like object, got %U", name);
        Py_DECREF(name);
    }
    return -1;
}

static PyObject *
py_chain(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    Chain c;
    Py_buffer view;
    if (!nargs_is("chain", nargs, 5) || parse_chain(args + 1, &c) != 0 ||
        raw_view(args[0], &view) != 0) {
        return NULL;
    }
    PyObject *keys = chain_keys(&c, view.buf, view.len);
    PyBuffer_Release(&view);
    return keys;
}

static PyObject *
py_blake2b(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (!nargs_is("blake2b", nargs, 3)) {
        return NULL;
    }
    PyObject *key = args[1];
    Py_ssize_t size = PyLong_Check(args[2]) ? PyLong_AsSsize_t(args[2]) : -1;
    if (size == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    if (size < 1 || size > KVF_BLAKE2B_MAX_OUT) {
        PyErr_Format(PyExc_ValueError, "digest_size must be 1 to %d, got %R", KVF_BLAKE2B_MAX_OUT,
                     args[2]);
        return NULL;
    }
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > KVF_BLAKE2B_MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "key must be at most %d bytes, got %R", KVF_BLAKE2B_MAX_KEY,
                     key);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    kvf_blake2b s;
    uint8_t out[KVF_BLAKE2B_MAX_OUT];
    kvf_blake2b_init(&s, (size_t)size, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
    kvf_blake2b_update(&s, view.buf, (size_t)view.len);
    kvf_blake2b_final(&s, out);
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)out, size);
}

static PyObject *
py_set_error(PyObject *Py_UNUSED(self), PyObject *cls)
{
    if (!PyType_Check(cls) ||
        !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        PyErr_Format(PyExc_TypeError, "set_error takes an Exception subclass, got %R", cls);
        return NULL;
    }
    Py_INCREF(cls);
    Py_SETREF(kvf_invalid, cls);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_FASTCALL, "pack(tokens) -> int32 bytes"},
    {"equal", (PyCFunction)(void (*)(void))py_equal, METH_FASTCALL,
     "equal(tokens, raw) -> whether pack(tokens) == raw"},
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
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_pagekeys",
    .m_doc = "Chained BLAKE2b page keys (see core/cache/keys.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__pagekeys(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    kvf_invalid = Py_NewRef(PyExc_ValueError);
    if (PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PAGE_SIZE", MAX_PAGE_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
