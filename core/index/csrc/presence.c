/* kvfabric.core.index._presence: the native core of core/index/presence.py.
 *
 * Presence(window_pages, has_full): per page key, a code per node slot that holds it
 * (a Cell: inline pairs while few slots do, a bitset where many do; presence_holders.c); per slot,
 * the pages it published; per key, its last publication. The same methods and results
 * as presence.Presence:
 *   open(slot) / close(slot): a slot takes a node / is cleared and freed.
 *   set_chain(slot, keys, first_depth, parent, mask): a chain's pages (presence_records.c).
 *   check(keys, parent): PrefixIndex's check of a chain, before anything changes.
 *   clear(slot); pages(slot) -> [(key, parent, depth, mask)]; count(slot).
 *   meta(key) -> (parent, depth) | None; keys() in insertion order; get(key) -> int.
 *   dense(key) -> bool: its holders are a bitset, not inline pairs.
 *   lookup(keys) -> [(slot, pages, device)]: the MatchRule's matches (lookups.c).
 * Every argument is checked before anything changes (ValueError). It holds no Python
 * objects, so the type is not tracked by the garbage collector. */
#include "presence.h"

#include <string.h>

Cell *
kvf_find(Presence *p, const uint8_t *key)
{
    size_t pos;
    Py_ssize_t e = ord_find(&p->held, key, &pos);
    return e < 0 ? NULL : p->cells + e;
}

/* `ones` for `words` words (the keys' cells do not depend on the slot count). */
static int
widen(Presence *p, Py_ssize_t words)
{
    uint64_t *ones = PyMem_Calloc((size_t)words, 8);
    if (!ones) {
        return PyErr_NoMemory(), -1;
    }
    memcpy(ones, p->ones, (size_t)p->words * 8);
    PyMem_Free(p->ones);
    p->ones = ones, p->words = words;
    return 0;
}

int
kvf_check_keys(PyObject *const *items, Py_ssize_t n, const char *what)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "%s keys must be %d-byte bytes", what, KEY_BYTES);
            return -1;
        }
    }
    return 0;
}

static int
is_key(PyObject *v)
{
    return PyBytes_CheckExact(v) && PyBytes_GET_SIZE(v) == KEY_BYTES;
}

/* An int from lo to hi, or a ValueError naming it. */
static int64_t
int_arg(PyObject *v, const char *name, int64_t lo, int64_t hi)
{
    int overflow = 0;
    long long x = PyLong_CheckExact(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : -1;
    if (!PyLong_CheckExact(v) || overflow || x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be an int from %lld to %lld, got %R", name,
                     (long long)lo, (long long)hi, v);
        return -1;
    }
    return x;
}

/* A chain's first depth: its last page's, first_depth + n - 1, fits 64 bits unsigned (the
 * events' wire type); 0 and *ok = 0 with a ValueError if not. */
static uint64_t
depth_arg(PyObject *v, Py_ssize_t n, int *ok)
{
    unsigned long long x = PyLong_CheckExact(v) ? PyLong_AsUnsignedLongLong(v) : 0;
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
    else if (PyLong_CheckExact(v) && (n == 0 || x <= UINT64_MAX - (uint64_t)(n - 1))) {
        return *ok = 1, x;
    }
    PyErr_Format(PyExc_ValueError, "first_depth must be an int from 0 to 2**64 - %zd, got %R",
                 n ? n : 1, v);
    return *ok = 0, 0;
}

/* The open slot `v` names, or a ValueError. */
static Pages *
open_slot(Presence *p, PyObject *v, Py_ssize_t *slot)
{
    int overflow = 0;
    long long x = PyLong_CheckExact(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : -1;
    if (!PyLong_CheckExact(v) || overflow || x < 0 || x >= p->nslots || !p->slots[x].open) {
        PyErr_Format(PyExc_ValueError, "slot %R is not open", v);
        return NULL;
    }
    *slot = (Py_ssize_t)x;
    return &p->slots[x];
}

static PyObject *
py_set_chain(Presence *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        return PyErr_Format(PyExc_TypeError,
                            "set_chain(slot, keys, first_depth, parent, mask) takes 5 arguments");
    }
    Py_ssize_t slot;
    Pages *s = open_slot(p, args[0], &slot);
    if (s == NULL) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "set_chain keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t mask = -1;
    int ok = 0;
    uint64_t depth = 0;
    if (kvf_check_keys(items, n, "chain") == 0 && (depth = depth_arg(args[2], n, &ok), ok)) {
        if (!is_key(args[3])) {
            PyErr_Format(PyExc_ValueError, "chain parent must be %d bytes", KEY_BYTES);
        }
        else {
            mask = int_arg(args[4], "mask", 0, MAX_MASK);
        }
    }
    int rc = mask < 0 ? -1
                      : kvf_set_chain(p, s, slot, items, n, depth,
                                      (const uint8_t *)PyBytes_AS_STRING(args[3]), (int)mask);
    Py_DECREF(seq);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
py_check(Presence *Py_UNUSED(p), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "check(keys, parent) takes 2 arguments");
    }
    PyObject *seq = PySequence_Fast(args[0], "chain keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    int bad = kvf_check_keys(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), "chain");
    Py_DECREF(seq);
    if (bad) {
        return NULL;
    }
    if (!is_key(args[1])) {
        return PyErr_Format(PyExc_ValueError, "chain parent must be %d bytes", KEY_BYTES);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_open(Presence *p, PyObject *arg)
{
    int64_t slot = int_arg(arg, "slot", 0, MAX_SLOTS - 1);
    if (slot < 0) {
        return NULL;
    }
    if (slot >= p->words * SLOTS_PER_WORD && widen(p, slot / SLOTS_PER_WORD + 1) < 0) {
        return NULL;
    }
    if (slot >= p->nslots) {
        int32_t *local = PyMem_Realloc(p->local, (size_t)(slot + 1) * sizeof(int32_t));
        if (local == NULL) {
            return PyErr_NoMemory();
        }
        p->local = local; /* bigger, still valid for the old slot count */
        Pages *slots = PyMem_Realloc(p->slots, (size_t)(slot + 1) * sizeof(Pages));
        if (slots == NULL) {
            return PyErr_NoMemory();
        }
        memset(slots + p->nslots, 0, (size_t)(slot + 1 - p->nslots) * sizeof(Pages));
        memset(local + p->nslots, 0xff, (size_t)(slot + 1 - p->nslots) * sizeof(int32_t));
        p->slots = slots, p->nslots = slot + 1;
    }
    p->slots[slot].open = 1;
    p->ones[slot / SLOTS_PER_WORD] |= 1ULL << CODE_BITS * (slot % SLOTS_PER_WORD);
    Py_RETURN_NONE;
}

static PyObject *
py_close(Presence *p, PyObject *arg)
{
    Py_ssize_t slot;
    Pages *s = open_slot(p, arg, &slot);
    if (s == NULL) {
        return NULL;
    }
    kvf_clear(p, s, slot);
    s->open = 0;
    p->ones[slot / SLOTS_PER_WORD] &= ~(1ULL << CODE_BITS * (slot % SLOTS_PER_WORD));
    Py_RETURN_NONE;
}

static PyObject *
py_clear(Presence *p, PyObject *arg)
{
    Py_ssize_t slot;
    Pages *s = open_slot(p, arg, &slot);
    if (s == NULL) {
        return NULL;
    }
    kvf_clear(p, s, slot);
    Py_RETURN_NONE;
}

static PyObject *
py_pages(Presence *p, PyObject *arg)
{
    Py_ssize_t slot;
    Pages *s = open_slot(p, arg, &slot);
    return s == NULL ? NULL : kvf_pages(p, s);
}

static PyObject *
py_count(Presence *p, PyObject *arg)
{
    Py_ssize_t slot;
    Pages *s = open_slot(p, arg, &slot);
    return s == NULL ? NULL : PyLong_FromSsize_t(s->set.live);
}

static PyObject *
py_meta(Presence *p, PyObject *key)
{
    if (!is_key(key)) {
        return PyErr_Format(PyExc_ValueError, "meta key must be %d-byte bytes", KEY_BYTES);
    }
    return kvf_meta(p, (const uint8_t *)PyBytes_AS_STRING(key));
}

static PyObject *
py_keys(Presence *p, PyObject *Py_UNUSED(unused))
{
    PyObject *out = PyList_New(p->held.live);
    Py_ssize_t n = 0;
    for (Py_ssize_t e = 0; out != NULL && e < p->held.used; e++) {
        if (p->held.dead[e]) {
            continue;
        }
        PyObject *k =
            PyBytes_FromStringAndSize((const char *)p->held.keys + e * KEY_BYTES, KEY_BYTES);
        if (k == NULL) {
            Py_CLEAR(out);
        }
        else {
            PyList_SET_ITEM(out, n++, k);
        }
    }
    return out;
}

/* The cell's codes as words (its highest holder's word the last), in *bits; the count. */
static Py_ssize_t
cell_words(const Cell *c, uint64_t **bits)
{
    Py_ssize_t n = 0;
    for (Holders h = holders_of(c); holders_next(&h);) {
        n = h.slot / SLOTS_PER_WORD + 1 > n ? h.slot / SLOTS_PER_WORD + 1 : n;
    }
    if ((*bits = PyMem_Calloc((size_t)n + 1, 8)) == NULL) {
        return PyErr_NoMemory(), -1;
    }
    for (Holders h = holders_of(c); holders_next(&h);) {
        (*bits)[h.slot / SLOTS_PER_WORD] |= (uint64_t)h.code
                                            << CODE_BITS * (h.slot % SLOTS_PER_WORD);
    }
    return n;
}

static PyObject *
py_get(Presence *p, PyObject *key)
{
    if (kvf_check_keys(&key, 1, "get") < 0) {
        return NULL;
    }
    const Cell *c = kvf_find(p, (const uint8_t *)PyBytes_AS_STRING(key));
    uint64_t *bits = NULL;
    Py_ssize_t words = c == NULL ? 0 : cell_words(c, &bits);
    if (words < 0) {
        return NULL;
    }
    PyObject *out = PyLong_FromLong(0), *shift = PyLong_FromLong(64);
    for (Py_ssize_t i = words - 1; out != NULL && shift != NULL && i >= 0; i--) {
        PyObject *word = PyLong_FromUnsignedLongLong(bits[i]), *up = PyNumber_Lshift(out, shift);
        Py_SETREF(out, up && word ? PyNumber_Or(up, word) : NULL);
        Py_XDECREF(up), Py_XDECREF(word);
    }
    if (shift == NULL) {
        Py_CLEAR(out);
    }
    Py_XDECREF(shift);
    PyMem_Free(bits);
    return out;
}

static PyObject *
py_dense(Presence *p, PyObject *key)
{
    if (kvf_check_keys(&key, 1, "dense") < 0) {
        return NULL;
    }
    const Cell *c = kvf_find(p, (const uint8_t *)PyBytes_AS_STRING(key));
    return PyBool_FromLong(c != NULL && cell_dense(c));
}

static PyObject *
py_lookup(Presence *p, PyObject *keys)
{
    return kvf_lookup(p, keys);
}

static size_t
ordered_bytes(const Ordered *o, size_t row)
{
    return (size_t)o->cap * (KEY_BYTES + 1 + row) +
           (o->index ? (o->mask + 1) * sizeof(int32_t) : 0);
}

static PyObject *
py_sizeof(Presence *p, PyObject *Py_UNUSED(unused))
{
    size_t n = sizeof(Presence) + ordered_bytes(&p->held, sizeof(Cell) + KEY_BYTES + 8) +
               8 * (size_t)(p->dense_words + p->words + p->scratch_len + p->found_len) +
               4 * (size_t)p->order_len + sizeof(Place) * (size_t)p->places_len +
               (size_t)p->nslots * (sizeof(Pages) + sizeof(int32_t));
    for (Py_ssize_t s = 0; s < p->nslots; s++) {
        n += ordered_bytes(&p->slots[s].set, 1) + ordered_bytes(&p->slots[s].own, KEY_BYTES + 8);
    }
    return PyLong_FromSize_t(n);
}

static Py_ssize_t
presence_len(Presence *p)
{
    return p->held.live;
}

static PyObject *
presence_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t window;
    int has_full;
    static char *names[] = {"window_pages", "has_full", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "np:Presence", names, &window, &has_full)) {
        return NULL;
    }
    if (window < 0) {
        return PyErr_Format(PyExc_ValueError, "window_pages must be >= 0, got %zd", window);
    }
    Presence *p = (Presence *)type->tp_alloc(type, 0);
    if (p == NULL) {
        return NULL;
    }
    p->window = window, p->has_full = has_full, p->words = 1;
    p->ones = PyMem_Calloc(1, 8);
    if (!p->ones) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    return (PyObject *)p;
}

static void
presence_dealloc(Presence *p)
{
    kvf_free_held(p);
    for (Py_ssize_t s = 0; s < p->nslots; s++) {
        kvf_free_pages(&p->slots[s]);
    }
    PyMem_Free(p->slots), PyMem_Free(p->ones), PyMem_Free(p->scratch), PyMem_Free(p->local);
    PyMem_Free(p->found), PyMem_Free(p->order), PyMem_Free(p->places);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef presence_methods[] = {
    {"set_chain", FAST(py_set_chain), "set_chain(slot, keys, first_depth, parent, mask)"},
    {"check", FAST(py_check), "check(keys, parent): a chain's keys and parent, or ValueError"},
    {"open", (PyCFunction)py_open, METH_O, "open(slot): a node takes the slot"},
    {"close", (PyCFunction)py_close, METH_O, "close(slot): the slot is cleared and free"},
    {"clear", (PyCFunction)py_clear, METH_O, "clear(slot): the slot holds nothing"},
    {"pages", (PyCFunction)py_pages, METH_O, "pages(slot) -> [(key, parent, depth, mask)]"},
    {"count", (PyCFunction)py_count, METH_O, "count(slot) -> pages the slot holds"},
    {"meta", (PyCFunction)py_meta, METH_O, "meta(key) -> (parent, depth) of its last publication"},
    {"lookup", (PyCFunction)py_lookup, METH_O, "lookup(keys) -> [(slot, pages, device)]"},
    {"keys", (PyCFunction)py_keys, METH_NOARGS, "every held key, in insertion order"},
    {"get", (PyCFunction)py_get, METH_O, "get(key) -> the key's packed codes (0: not held)"},
    {"dense", (PyCFunction)py_dense, METH_O, "dense(key) -> its holders are a bitset, not pairs"},
    {"__sizeof__", (PyCFunction)py_sizeof, METH_NOARGS, "bytes held"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods presence_seq = {.sq_length = (lenfunc)presence_len};

static PyTypeObject PresenceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric.core.index._presence.Presence",
    .tp_basicsize = sizeof(Presence),
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no Python references held: not GC-tracked */
    .tp_doc = "The prefix index's core table (see core/index/presence.py).",
    .tp_new = presence_new,
    .tp_dealloc = (destructor)presence_dealloc,
    .tp_methods = presence_methods,
    .tp_as_sequence = &presence_seq,
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_presence",
    .m_doc = "The prefix index's core table (see core/index/presence.py).",
    .m_size = -1,
    .m_methods = NULL,
};

PyMODINIT_FUNC
PyInit__presence(void)
{
    if (PyType_Ready(&PresenceType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0 ||
        PyModule_AddIntConstant(m, "SPARSE_MAX", SPARSE_MAX) < 0 ||
        PyModule_AddIntConstant(m, "SPARSE_BACK", SPARSE_BACK) < 0 ||
        PyModule_AddObjectRef(m, "Presence", (PyObject *)&PresenceType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
