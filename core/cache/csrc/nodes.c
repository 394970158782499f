/* TreeNode in C: the attributes and methods of core/cache/nodes.py's TreeNode, over the
 * same Python containers. The type is not a garbage-collector type (issue #14): a node, its
 * children dict, its lists and the tree's dicts of nodes stay out of the collector's
 * tracked set, so collections never walk the tree. Parents and children still form
 * cycles while a node is attached: RadixTree breaks them when it goes away (radix.py's
 * unlink). Without the trashcan (it needs a GC type), node_dealloc defers deep frees. */
#include "nodes.h"
#include <structmember.h>

PyObject *radix_absent_page, *radix_zero;

int
radix_is_absent(PyObject *page)
{
    /* Only ints: a page of another type could run Python code that frees what the
     * caller holds borrowed (the tree never stores one; one planted by hand is refused). */
    if (!PyLong_CheckExact(page)) {
        PyErr_Format(PyExc_TypeError, "pages must be ints, got %.80s", Py_TYPE(page)->tp_name);
        return -1;
    }
    int overflow;
    long v = PyLong_AsLongAndOverflow(page, &overflow);
    return !overflow && v == -1;
}

PyObject *
radix_untrack_leaf(PyObject *list)
{
    if (list == NULL || !PyList_CheckExact(list) || !PyObject_GC_IsTracked(list)) {
        return list;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        if (PyObject_GC_IsTracked(PyList_GET_ITEM(list, i))) {
            return list;
        }
    }
    PyObject_GC_UnTrack(list);
    return list;
}

/* --- the object fields, type-checked on every store so the C side can trust them ---------- */
static int
check_field(const char *name, PyObject *value)
{
    int ok;
    const char *want;
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "TreeNode.%s cannot be deleted", name);
        return -1;
    }
    /* Exact types: a subclass's methods would run Python code inside the primitives. */
    switch (name[0]) {
    case 'k':
        ok = PyList_CheckExact(value), want = "a list";
        break; /* keys */
    case 't':
        ok = PyBytes_CheckExact(value), want = "bytes";
        break; /* tokens */
    case 'p':
        ok = value == Py_None || IS_NODE(value), want = "a TreeNode or None";
        break;
    case 'c':
        ok = PyDict_CheckExact(value), want = "a dict";
        break; /* children */
    default:
        ok = PyList_CheckExact(value), want = "a list";
        break; /* slots, locks */
    }
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "TreeNode.%s must be %s, got %.80s", name, want,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    return 0;
}

#define FIELD(NAME)                                                                               \
    static PyObject *get_##NAME(Node *self, void *Py_UNUSED(c))                                   \
    {                                                                                             \
        if (self->NAME == NULL) {                                                                 \
            return PyErr_Format(PyExc_AttributeError, "TreeNode was cleared");                    \
        }                                                                                         \
        return Py_NewRef(self->NAME);                                                             \
    }                                                                                             \
    static int set_##NAME(Node *self, PyObject *value, void *Py_UNUSED(c))                        \
    {                                                                                             \
        if (check_field(#NAME, value) < 0) {                                                      \
            return -1;                                                                            \
        }                                                                                         \
        Py_SETREF(self->NAME, Py_NewRef(value));                                                  \
        return 0;                                                                                 \
    }
FIELD(keys)
FIELD(tokens)
FIELD(parent)
FIELD(children)
FIELD(slots)
FIELD(locks)

/* [a, b], stealing both (NULL where either is, or on failure). */
static PyObject *
pair(PyObject *a, PyObject *b)
{
    PyObject *list = a && b ? PyList_New(2) : NULL;
    if (list == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    PyList_SET_ITEM(list, 0, a);
    PyList_SET_ITEM(list, 1, b);
    return radix_untrack_leaf(list);
}

/* One row of [None, None] (per pool) per tier: device, host, disk. */
static PyObject *
tiers(void)
{
    PyObject *list = PyList_New(RADIX_TIERS);
    for (Py_ssize_t t = 0; list != NULL && t < RADIX_TIERS; t++) {
        PyObject *row = pair(Py_NewRef(Py_None), Py_NewRef(Py_None));
        if (row == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, t, row);
    }
    return list == NULL ? NULL : radix_untrack_leaf(list);
}

static Py_ssize_t live; /* nodes allocated and not yet freed: live_nodes(), for tests */

Node *
radix_node_new(PyObject *keys, PyObject *tokens, PyObject *parent, long long start)
{
    Node *node = PyObject_New(Node, &radix_NodeType);
    if (node == NULL) {
        return NULL;
    }
    live++;
    node->keys = Py_NewRef(radix_untrack_leaf(keys));
    node->tokens = Py_NewRef(tokens);
    node->parent = Py_NewRef(parent);
    node->children = PyDict_New();
    node->slots = tiers();                                            /* [tier][pool] */
    node->locks = pair(Py_NewRef(radix_zero), Py_NewRef(radix_zero)); /* per pool */
    node->start = start;
    node->end = parent == Py_None ? 0 : start + PyList_GET_SIZE(keys);
    node->last_access = node->hits = 0;
    if (node->children == NULL || node->slots == NULL || node->locks == NULL) {
        Py_DECREF(node);
        return NULL;
    }
    return node;
}

static PyObject *
node_construct(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds)
{
    static char *names[] = {"keys", "tokens", "parent", "start", NULL};
    PyObject *keys, *tokens, *parent;
    long long start;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOL:TreeNode", names, &keys, &tokens, &parent,
                                     &start)) {
        return NULL;
    }
    if (check_field("keys", keys) < 0 || check_field("tokens", tokens) < 0 ||
        check_field("parent", parent) < 0) {
        return NULL;
    }
    return (PyObject *)radix_node_new(keys, tokens, parent, start);
}

/* Freeing a node frees its parent and its children dict (so its children) where it held
 * their last references: a long chain would recurse once per node and overflow the C
 * stack. Past DEFER_DEPTH nested frees, a node waits on `deferred` instead, linked through
 * its tokens (released first: bytes, whose free cannot recurse), and the outermost free
 * on this thread frees the waiting ones one after another. */
#define DEFER_DEPTH 64
static _Thread_local int freeing; /* node_dealloc calls on this thread's stack */
static _Thread_local Node *deferred;

static void
release(Node *self)
{
    Py_CLEAR(self->keys);
    Py_CLEAR(self->tokens);
    Py_CLEAR(self->parent);
    Py_CLEAR(self->children);
    Py_CLEAR(self->slots);
    Py_CLEAR(self->locks);
    PyObject_Del(self);
    live--;
}

static void
node_dealloc(Node *self)
{
    if (freeing >= DEFER_DEPTH) {
        Py_CLEAR(self->tokens);
        self->tokens = (PyObject *)deferred;
        deferred = self;
        return;
    }
    freeing++;
    release(self);
    while (freeing == 1 && deferred != NULL) {
        Node *next = deferred;
        deferred = (Node *)next->tokens;
        next->tokens = NULL;
        release(next);
    }
    freeing--;
}

static PyObject *
live_nodes(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(unused))
{
    return PyLong_FromSsize_t(live);
}

PyMethodDef radix_node_functions[] = {
    {"live_nodes", live_nodes, METH_NOARGS, "live_nodes() -> TreeNodes made and not yet freed"},
    {NULL},
};

/* --- methods ----------------------------------------------------------------------------- */
Py_ssize_t
radix_node_n(Node *node)
{
    if (node->keys == NULL) {
        PyErr_SetString(PyExc_AttributeError, "TreeNode was cleared");
        return -1;
    }
    return node->parent == Py_None ? 0 : PyList_GET_SIZE(node->keys);
}

PyObject *
radix_node_tier(Node *node, Py_ssize_t tier)
{
    if (node->slots == NULL || tier < 0 || tier >= PyList_GET_SIZE(node->slots)) {
        PyErr_Format(PyExc_IndexError, "no tier %zd in a TreeNode's slots", tier);
        return NULL;
    }
    PyObject *row = PyList_GET_ITEM(node->slots, tier);
    if (!PyList_CheckExact(row)) {
        PyErr_SetString(PyExc_TypeError, "a TreeNode's slots must be lists per tier");
        return NULL;
    }
    return row;
}

/* slots[tier][pool] (borrowed: a list or None). */
static PyObject *
slot_at(Node *node, PyObject *tier, PyObject *pool)
{
    Py_ssize_t t = PyNumber_AsSsize_t(tier, PyExc_IndexError);
    Py_ssize_t p = PyNumber_AsSsize_t(pool, PyExc_IndexError);
    if ((t == -1 || p == -1) && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *row = radix_node_tier(node, t);
    if (row == NULL) {
        return NULL;
    }
    if (p < 0 || p >= PyList_GET_SIZE(row)) {
        PyErr_Format(PyExc_IndexError, "no pool %zd in a TreeNode's slots", p);
        return NULL;
    }
    return PyList_GET_ITEM(row, p);
}

static PyObject *
get_n(Node *self, void *Py_UNUSED(c))
{
    Py_ssize_t n = radix_node_n(self);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *
get_is_root(Node *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(self->parent == Py_None);
}

static PyObject *
get_up(Node *self, void *Py_UNUSED(c))
{
    if (self->parent == NULL) {
        return PyErr_Format(PyExc_AttributeError, "TreeNode was cleared");
    }
    if (self->parent == Py_None) {
        PyErr_SetString(PyExc_AssertionError, "a namespace root has no parent");
        return NULL;
    }
    return Py_NewRef(self->parent);
}

static PyObject *
node_pages_of(Node *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "pages_of(tier, pool)");
    }
    PyObject *pages = slot_at(self, args[0], args[1]);
    if (pages == Py_None) {
        PyObject *why = Py_BuildValue("((OOO))", self, args[0], args[1]);
        if (why != NULL) {
            PyErr_SetObject(PyExc_AssertionError, why); /* args: one tuple */
        }
        Py_XDECREF(why);
        return NULL;
    }
    return pages == NULL ? NULL : Py_NewRef(pages);
}

/* Calls `each(pages, arg)` for slots[t][pool] of every t in `tiers` (all when NULL)
 * until it returns nonzero; returns that, 0, or -1 on error. */
static int
any_tier(Node *self, PyObject *pool, PyObject *tiers, int (*each)(PyObject *, Py_ssize_t),
         Py_ssize_t arg)
{
    PyObject *seq = tiers ? PySequence_Fast(tiers, "tiers must be a sequence") : NULL;
    if (tiers && seq == NULL) {
        return -1;
    }
    Py_ssize_t count = seq ? PySequence_Fast_GET_SIZE(seq) : RADIX_TIERS;
    int found = 0;
    for (Py_ssize_t i = 0; i < count && !found; i++) {
        PyObject *t = seq ? Py_NewRef(PySequence_Fast_GET_ITEM(seq, i)) : PyLong_FromSsize_t(i);
        PyObject *pages = t ? slot_at(self, t, pool) : NULL;
        Py_XDECREF(t);
        found = pages == NULL ? -1 : pages == Py_None ? 0 : each(pages, arg);
    }
    Py_XDECREF(seq);
    return found;
}

static int
holds_some(PyObject *Py_UNUSED(pages), Py_ssize_t Py_UNUSED(unused))
{
    return 1;
}

static int
held_at(PyObject *pages, Py_ssize_t offset)
{
    if (!PyList_CheckExact(pages)) {
        PyErr_SetString(PyExc_TypeError, "page lists must be lists");
        return -1;
    }
    PyObject *page = PySequence_GetItem(pages, offset);
    if (page == NULL) {
        return -1;
    }
    int absent = radix_is_absent(page);
    Py_DECREF(page);
    return absent < 0 ? -1 : !absent;
}

static PyObject *
node_has(Node *self, PyObject *args)
{
    PyObject *pool, *tiers = NULL;
    if (!PyArg_ParseTuple(args, "O|O:has", &pool, &tiers)) {
        return NULL;
    }
    int r = any_tier(self, pool, tiers, holds_some, 0);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *
node_page_has(Node *self, PyObject *args)
{
    PyObject *pool, *tiers = NULL;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "nO|O:page_has", &offset, &pool, &tiers)) {
        return NULL;
    }
    int r = any_tier(self, pool, tiers, held_at, offset);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *
node_count(Node *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "count(tier, pool)");
    }
    PyObject *pages = slot_at(self, args[0], args[1]);
    if (pages == NULL) {
        return NULL;
    }
    if (pages == Py_None) {
        return PyLong_FromLong(0);
    }
    Py_ssize_t n = radix_held(pages);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *
node_repr(Node *self)
{
    if (self->keys == NULL || PyList_GET_SIZE(self->keys) == 0) {
        return PyUnicode_FromString("TreeNode(<cleared>)");
    }
    PyObject *hex = PyObject_CallMethod(PyList_GET_ITEM(self->keys, 0), "hex", NULL);
    PyObject *key = hex ? PyUnicode_Substring(hex, 0, 8) : NULL;
    Py_XDECREF(hex);
    if (key == NULL) {
        return NULL;
    }
    PyObject *out =
        PyUnicode_FromFormat("TreeNode(start=%lld, n=%zd, key=%U, slots=%R, locks=%R)",
                             self->start, radix_node_n(self), key, self->slots, self->locks);
    Py_DECREF(key);
    return out;
}

static PyGetSetDef node_getset[] = {
    {"keys", (getter)get_keys, (setter)set_keys, NULL, NULL},
    {"tokens", (getter)get_tokens, (setter)set_tokens, NULL, NULL},
    {"parent", (getter)get_parent, (setter)set_parent, NULL, NULL},
    {"children", (getter)get_children, (setter)set_children, NULL, NULL},
    {"slots", (getter)get_slots, (setter)set_slots, NULL, NULL},
    {"locks", (getter)get_locks, (setter)set_locks, NULL, NULL},
    {"n", (getter)get_n, NULL, "pages in the run (0 for a namespace root)", NULL},
    {"is_root", (getter)get_is_root, NULL, NULL, NULL},
    {"up", (getter)get_up, NULL, "the parent of a node that is not a namespace root", NULL},
    {NULL},
};

static PyMemberDef node_members[] = {
    {"start", T_LONGLONG, offsetof(Node, start), 0, NULL},
    {"end", T_LONGLONG, offsetof(Node, end), 0, NULL},
    {"last_access", T_LONGLONG, offsetof(Node, last_access), 0, NULL},
    {"hits", T_LONGLONG, offsetof(Node, hits), 0, NULL},
    {NULL},
};

static PyMethodDef node_methods[] = {
    {"pages_of", (PyCFunction)(void (*)(void))node_pages_of, METH_FASTCALL, NULL},
    {"has", (PyCFunction)node_has, METH_VARARGS, NULL},
    {"page_has", (PyCFunction)node_page_has, METH_VARARGS, NULL},
    {"count", (PyCFunction)(void (*)(void))node_count, METH_FASTCALL, NULL},
    {NULL},
};

PyTypeObject radix_NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric.core.cache._radix.TreeNode",
    .tp_doc = "A run of whole pages in the radix tree (see core/cache/nodes.py).",
    .tp_basicsize = sizeof(Node),
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no GC: see the top of this file */
    .tp_new = node_construct,
    .tp_dealloc = (destructor)node_dealloc,
    .tp_repr = (reprfunc)node_repr,
    .tp_getset = node_getset,
    .tp_members = node_members,
    .tp_methods = node_methods,
};
