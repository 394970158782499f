/* TreeState: RadixTree's own fields as a C type, the base of the native RadixTree
 * (radix.py), with the methods a request calls natively: walk (nodes_tree.c) and insert_free
 * (radix_insert.c). */
#include "nodes.h"
#include <stddef.h>
#include <structmember.h>

static PyObject *
state_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    /* RadixTree.__init__ fills the fields: every object one starts as None. */
    return type->tp_alloc(type, 0);
}

static int
state_traverse(TreeState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->roots);
    Py_VISIT(self->by_first_key);
    Py_VISIT(self->owned);
    Py_VISIT(self->protected);
    Py_VISIT(self->changes); /* a change log's limit may close over the tree: a cycle */
    Py_VISIT(self->dirty);
    return 0;
}

static int
state_clear(TreeState *self)
{
    Py_CLEAR(self->roots);
    Py_CLEAR(self->by_first_key);
    Py_CLEAR(self->owned);
    Py_CLEAR(self->protected);
    Py_CLEAR(self->changes);
    Py_CLEAR(self->dirty);
    return 0;
}

static void
state_dealloc(TreeState *self)
{
    PyObject_GC_UnTrack(self);
    state_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define LONG(NAME, DOC)   {#NAME, T_LONGLONG, offsetof(TreeState, NAME), 0, DOC}
#define OBJECT(NAME, DOC) {#NAME, T_OBJECT, offsetof(TreeState, NAME), 0, DOC}

static PyMemberDef state_members[] = {
    {"page_bytes", T_PYSSIZET, offsetof(TreeState, page_bytes), 0, "bytes of a page's tokens"},
    LONG(clock, "bumped by every touch"),
    LONG(node_count, "nodes below the roots"),
    LONG(page_count, "pages along all runs"),
    LONG(version, "bumped by every change of shape"),
    OBJECT(roots, "namespace root key -> root"),
    OBJECT(by_first_key, "a node's first page's key -> the node"),
    OBJECT(owned, "[tier][pool] pages held by nodes"),
    OBJECT(protected, "[tier][pool] pages held by locked nodes"),
    OBJECT(changes, "the change log, or None"),
    OBJECT(dirty, "nodes changed since candidates.py took them, or None"),
    {NULL},
};

/* RadixTree.walk(root_key, raw) on the tree's own roots and page size: one call. */
static PyObject *
state_walk(TreeState *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(2, "walk");
    return radix_walk_from(self->roots, args[0], args[1], self->page_bytes);
}

static PyMethodDef state_methods[] = {
    {"walk", (PyCFunction)(void (*)(void))state_walk, METH_FASTCALL,
     "walk(root_key, raw) -> (path, pages matched): RadixTree.walk in one call"},
    {"insert_free", (PyCFunction)(void (*)(void))radix_insert_free, METH_FASTCALL,
     "insert_free(path, tokens, keyer, todo, tier, allocators, hook, fill, hold, got) -> "
     "None | (nodes, failed): RadixTree.insert_free in one call"},
    {NULL},
};

PyTypeObject radix_TreeStateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric.core.cache._radix.TreeState",
    .tp_basicsize = sizeof(TreeState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "RadixTree's fields, kept in C for insert_free.",
    .tp_new = state_new,
    .tp_traverse = (traverseproc)state_traverse,
    .tp_clear = (inquiry)state_clear,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_members = state_members,
    .tp_methods = state_methods,
};
