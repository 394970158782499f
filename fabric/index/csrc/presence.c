/* kvfabric.fabric.index._presence: the native core of fabric/index/presence.py.
 *
 * Presence(window_pages, has_full): per page key, a nibble per node slot (what
 * prefix_index._code packs), in a bitset that grows with the slot count.
 *   open(slot) / close(slot): a node takes / gives up a slot (its bits must be cleared).
 *   set(slot, keys, code) -> removed: the slot's nibble over a run of keys, in order;
 *       code 0 clears, and keys no slot holds any more are deleted and returned.
 *   lookup(keys) -> [(slot, pages, device)]: the MatchRule's matches (lookup.c).
 *   keys() -> every held key in insertion order; get(key) -> packed int (0: not held).
 * Every input is checked before anything changes; room is reserved before a run is
 * written, so a run is applied whole or not at all. It holds no Python objects, so the
 * type is not tracked by the garbage collector. */
#include "presence.h"

#include <string.h>

static uint64_t hash_key(const uint8_t *key) {
    uint64_t a, b;
    memcpy(&a, key, 8);
    memcpy(&b, key + 8, 8);
    uint64_t h = a ^ (b * 0x9E3779B97F4A7C15ULL);      /* keys may be chosen, not only hashed */
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h ^ (h >> 29);
}

static int is_zero(const uint64_t *w, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (w[i])
            return 0;
    return 1;
}

/* The entry of `key`, or -1; *pos: its index position, else where it would go. */
static Py_ssize_t probe(Presence *p, const uint8_t *key, size_t *pos) {
    if (p->index == NULL)
        return -1;                      /* nothing ever held; set reserves before inserting */
    size_t i = hash_key(key) & p->mask, tomb = SIZE_MAX;
    for (;; i = (i + 1) & p->mask) {
        int32_t e = p->index[i];
        if (e == -1) {
            *pos = tomb != SIZE_MAX ? tomb : i;
            return -1;
        }
        if (e == -2) {
            if (tomb == SIZE_MAX)
                tomb = i;
        } else if (memcmp(p->keys + (size_t)e * KEY_BYTES, key, KEY_BYTES) == 0) {
            *pos = i;
            return e;
        }
    }
}

uint64_t *kvf_find(Presence *p, const uint8_t *key) {
    size_t pos;
    Py_ssize_t e = probe(p, key, &pos);
    return e < 0 ? NULL : p->bits + e * p->words;
}

/* Room for `extra` more entries: live ones moved, in order, into arrays of `cap` (or more)
 * entries, with a fresh index. Nothing changes if memory runs out. */
static int reserve(Presence *p, Py_ssize_t extra) {
    if (p->used + extra <= p->cap)
        return 0;
    Py_ssize_t need = p->live + extra, cap = p->cap;
    if (need * 2 > cap)
        cap = need > 2 * cap ? need : 2 * cap;
    if (cap < 8)
        cap = 8;
    size_t size = 16;
    while (size < (size_t)cap * 2)
        size <<= 1;
    if ((size_t)cap > (size_t)INT32_MAX)
        return PyErr_NoMemory(), -1;
    uint8_t *keys = PyMem_Malloc((size_t)cap * KEY_BYTES);
    uint64_t *bits = PyMem_Malloc((size_t)cap * (size_t)p->words * 8);
    int32_t *index = PyMem_Malloc(size * sizeof(int32_t));
    if (!keys || !bits || !index) {
        PyMem_Free(keys), PyMem_Free(bits), PyMem_Free(index);
        return PyErr_NoMemory(), -1;
    }
    memset(index, 0xff, size * sizeof(int32_t));
    Py_ssize_t n = 0, w = p->words;
    for (Py_ssize_t e = 0; e < p->used; e++) {
        if (is_zero(p->bits + e * w, w))
            continue;
        memcpy(keys + n * KEY_BYTES, p->keys + e * KEY_BYTES, KEY_BYTES);
        memcpy(bits + n * w, p->bits + e * w, (size_t)w * 8);
        size_t i = hash_key(keys + n * KEY_BYTES) & (size - 1);
        while (index[i] != -1)
            i = (i + 1) & (size - 1);
        index[i] = (int32_t)n++;
    }
    PyMem_Free(p->keys), PyMem_Free(p->bits), PyMem_Free(p->index);
    p->keys = keys, p->bits = bits, p->index = index, p->mask = size - 1;
    p->used = p->live = n;
    p->cap = cap;
    return 0;
}

/* Bits per key for `words` words: every entry widened with zero nibbles. */
static int widen(Presence *p, Py_ssize_t words) {
    Py_ssize_t old = p->words;
    uint64_t *bits = PyMem_Calloc((size_t)(p->cap ? p->cap : 1) * (size_t)words, 8);
    uint64_t *ones = PyMem_Calloc((size_t)words, 8);
    if (!bits || !ones) {
        PyMem_Free(bits), PyMem_Free(ones);
        return PyErr_NoMemory(), -1;
    }
    for (Py_ssize_t e = 0; e < p->used; e++)
        memcpy(bits + e * words, p->bits + e * old, (size_t)old * 8);
    memcpy(ones, p->ones, (size_t)old * 8);
    PyMem_Free(p->bits), PyMem_Free(p->ones);
    p->bits = bits, p->ones = ones, p->words = words;
    return 0;
}

int kvf_check_keys(PyObject *const *items, Py_ssize_t n, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "%s keys must be %d-byte bytes", what, KEY_BYTES);
            return -1;
        }
    return 0;
}

/* An int from lo to hi, or a ValueError naming it. */
static Py_ssize_t int_arg(PyObject *v, const char *name, Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t x = PyLong_CheckExact(v) ? PyLong_AsSsize_t(v) : -1;
    if (x == -1 && PyErr_Occurred())
        PyErr_Clear();
    if (!PyLong_CheckExact(v) || x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be an int from %zd to %zd, got %R", name, lo, hi, v);
        return -1;
    }
    return x;
}

static PyObject *py_set(Presence *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "set(slot, keys, code) takes 3 arguments");
    Py_ssize_t slot = int_arg(args[0], "slot", 0, p->words * SLOTS_PER_WORD - 1);
    Py_ssize_t code = slot < 0 ? -1 : int_arg(args[2], "code", 0, 15);
    if (code < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "set keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), word = slot / SLOTS_PER_WORD, w = p->words;
    PyObject **items = PySequence_Fast_ITEMS(seq), *removed = NULL;
    if (kvf_check_keys(items, n, "set") < 0 || (code && reserve(p, n) < 0) ||
        (removed = PyList_New(code ? 0 : n)) == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t clear = ~(0xFULL << 4 * (slot % SLOTS_PER_WORD)), put = (uint64_t)code << 4 * (slot % SLOTS_PER_WORD);
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(items[i]);
        size_t pos;
        Py_ssize_t e = probe(p, key, &pos);
        if (code) {
            if (e < 0) {               /* reserved above: room for every new key */
                e = p->used++;
                p->live++;
                p->index[pos] = (int32_t)e;
                memcpy(p->keys + e * KEY_BYTES, key, KEY_BYTES);
                memset(p->bits + e * w, 0, (size_t)w * 8);
            }
            p->bits[e * w + word] = (p->bits[e * w + word] & clear) | put;
        } else if (e >= 0) {
            p->bits[e * w + word] &= clear;
            if (is_zero(p->bits + e * w, w)) {
                p->index[pos] = -2;
                p->live--;
                PyList_SET_ITEM(removed, gone++, Py_NewRef(items[i]));
            }
        }
    }
    Py_DECREF(seq);
    if (gone < PyList_GET_SIZE(removed) && PyList_SetSlice(removed, gone, PyList_GET_SIZE(removed), NULL) < 0)
        Py_CLEAR(removed);     /* shrinking: not expected to fail */
    return removed;
}

static PyObject *py_open(Presence *p, PyObject *arg) {
    Py_ssize_t slot = int_arg(arg, "slot", 0, (Py_ssize_t)1 << 24);
    if (slot < 0)
        return NULL;
    if (slot >= p->words * SLOTS_PER_WORD && widen(p, slot / SLOTS_PER_WORD + 1) < 0)
        return NULL;
    p->ones[slot / SLOTS_PER_WORD] |= 1ULL << 4 * (slot % SLOTS_PER_WORD);
    Py_RETURN_NONE;
}

static PyObject *py_close(Presence *p, PyObject *arg) {
    Py_ssize_t slot = int_arg(arg, "slot", 0, p->words * SLOTS_PER_WORD - 1);
    if (slot < 0)
        return NULL;
    p->ones[slot / SLOTS_PER_WORD] &= ~(1ULL << 4 * (slot % SLOTS_PER_WORD));
    Py_RETURN_NONE;
}

static PyObject *py_keys(Presence *p, PyObject *unused) {
    PyObject *out = PyList_New(p->live);
    Py_ssize_t n = 0;
    for (Py_ssize_t e = 0; out != NULL && e < p->used; e++) {
        if (is_zero(p->bits + e * p->words, p->words))
            continue;
        PyObject *k = PyBytes_FromStringAndSize((const char *)p->keys + e * KEY_BYTES, KEY_BYTES);
        if (k == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, n++, k);
    }
    return out;
}

static PyObject *py_get(Presence *p, PyObject *key) {
    if (kvf_check_keys(&key, 1, "get") < 0)
        return NULL;
    uint64_t *bits = kvf_find(p, (const uint8_t *)PyBytes_AS_STRING(key));
    PyObject *out = PyLong_FromLong(0), *shift = PyLong_FromLong(64);
    for (Py_ssize_t i = p->words - 1; bits != NULL && out != NULL && shift != NULL && i >= 0; i--) {
        PyObject *word = PyLong_FromUnsignedLongLong(bits[i]), *up = PyNumber_Lshift(out, shift);
        Py_SETREF(out, up && word ? PyNumber_Or(up, word) : NULL);
        Py_XDECREF(up), Py_XDECREF(word);
    }
    if (shift == NULL)
        Py_CLEAR(out);
    Py_XDECREF(shift);
    return out;
}

static PyObject *py_lookup(Presence *p, PyObject *keys) { return kvf_lookup(p, keys); }

static PyObject *py_sizeof(Presence *p, PyObject *unused) {
    size_t n = sizeof(Presence) + (size_t)p->cap * (KEY_BYTES + 8 * (size_t)p->words)
               + (p->cap ? (p->mask + 1) * sizeof(int32_t) : 0) + 8 * (size_t)(p->words + p->scratch_len);
    return PyLong_FromSize_t(n);
}

static Py_ssize_t presence_len(Presence *p) { return p->live; }

static PyObject *presence_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t window;
    int has_full;
    static char *names[] = {"window_pages", "has_full", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "np:Presence", names, &window, &has_full))
        return NULL;
    if (window < 0)
        return PyErr_Format(PyExc_ValueError, "window_pages must be >= 0, got %zd", window);
    Presence *p = (Presence *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->window = window, p->has_full = has_full, p->words = 1;
    p->ones = PyMem_Calloc(1, 8);
    p->bits = PyMem_Calloc(1, 8);
    if (!p->ones || !p->bits) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    return (PyObject *)p;
}

static void presence_dealloc(Presence *p) {
    PyMem_Free(p->keys), PyMem_Free(p->bits), PyMem_Free(p->index);
    PyMem_Free(p->ones), PyMem_Free(p->scratch);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef presence_methods[] = {
    {"set", (PyCFunction)(void (*)(void))py_set, METH_FASTCALL, "set(slot, keys, code) -> removed keys"},
    {"open", (PyCFunction)py_open, METH_O, "open(slot): a node takes the slot"},
    {"close", (PyCFunction)py_close, METH_O, "close(slot): the slot is free (its bits cleared first)"},
    {"lookup", (PyCFunction)py_lookup, METH_O, "lookup(keys) -> [(slot, pages, device)]"},
    {"keys", (PyCFunction)py_keys, METH_NOARGS, "every held key, in insertion order"},
    {"get", (PyCFunction)py_get, METH_O, "get(key) -> the key's packed nibbles (0: not held)"},
    {"__sizeof__", (PyCFunction)py_sizeof, METH_NOARGS, "bytes held"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods presence_seq = {.sq_length = (lenfunc)presence_len};

static PyTypeObject PresenceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfabric.fabric.index._presence.Presence",
    .tp_basicsize = sizeof(Presence),
    .tp_flags = Py_TPFLAGS_DEFAULT,     /* no Python references held: not GC-tracked */
    .tp_doc = "Per page key, a 4-bit nibble per node slot (see fabric/index/presence.py).",
    .tp_new = presence_new,
    .tp_dealloc = (destructor)presence_dealloc,
    .tp_methods = presence_methods,
    .tp_as_sequence = &presence_seq,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_presence", "The prefix index's presence table (see fabric/index/presence.py).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__presence(void) {
    if (PyType_Ready(&PresenceType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddObjectRef(m, "Presence", (PyObject *)&PresenceType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
