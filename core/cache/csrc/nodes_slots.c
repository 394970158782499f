/* Pages and locks on C TreeNodes (set_pages, clear_pages, lock), keeping the tree's
 * owned/protected [tier][pool] counters, and the `_radix` module that exports them with
 * nodes_tree.c's primitives and the TreeNode type. Same order of effects as core/cache/nodes.py.
 */
#include "nodes.h"

/* node.slots[t] (borrowed), where pool p is, or NULL with an error; a page list there
 * must be a list (or None). Runs no Python code. */
PyObject *
radix_slot_row_at(Node *node, Py_ssize_t t, Py_ssize_t p)
{
    PyObject *row = radix_node_tier(node, t);
    if (row != NULL && (p < 0 || p >= PyList_GET_SIZE(row))) {
        PyErr_Format(PyExc_IndexError, "no pool %zd in a TreeNode's slots", p);
        return NULL;
    }
    PyObject *pages = row ? PyList_GET_ITEM(row, p) : NULL;
    if (pages != NULL && pages != Py_None && !PyList_CheckExact(pages)) {
        PyErr_SetString(PyExc_TypeError, "page lists must be lists");
        return NULL;
    }
    return row;
}

/* node.slots[tier] (borrowed) and the pool's index in it, or NULL with an error. Tier
 * and pool become indices first: their __index__ runs before any node state is read. */
PyObject *
radix_slot_row(Node *node, PyObject *tier, PyObject *pool, Py_ssize_t *t, Py_ssize_t *p)
{
    *t = radix_as_index(tier), *p = radix_as_index(pool);
    if ((*t == -1 || *p == -1) && PyErr_Occurred()) {
        return NULL;
    }
    return radix_slot_row_at(node, *t, *p);
}

/* Every item of a PySequence_Fast `seq` an int (not a subclass, whose __index__ or __eq__
 * could run Python code mid-change): 0, or -1 with a TypeError naming `what`. */
int
radix_all_ints(PyObject *seq, const char *what)
{
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        if (!PyLong_CheckExact(PySequence_Fast_GET_ITEM(seq, i))) {
            PyErr_Format(PyExc_TypeError, "%s must be ints", what);
            return -1;
        }
    }
    return 0;
}

/* Gives `pages` to node's slots[t][pool] (`row`; `tier` and `pool` as given, for errors) at
 * `offsets` (both PySequence_Fast), counting them: set_pages without the argument parsing.
 * 0, or -1 with an error set. */
int
radix_give_pages(Node *node, PyObject *row, Py_ssize_t t, Py_ssize_t p, PyObject *tier,
                 PyObject *pool, PyObject *offsets, PyObject *pages, PyObject *owned,
                 PyObject *protected)
{
    Py_ssize_t n = radix_node_n(node);
    if (n < 0 || radix_all_ints(offsets, "offsets") < 0 || radix_all_ints(pages, "pages") < 0) {
        return -1;
    }
    PyObject *current = PyList_GET_ITEM(row, p);
    Py_ssize_t given = PySequence_Fast_GET_SIZE(pages), at = PySequence_Fast_GET_SIZE(offsets);
    if (current == Py_None && at == n) { /* a whole run, in order */
        PyObject *copy = radix_untrack_leaf(PySequence_List(pages));
        if (copy == NULL || PyList_SetItem(row, p, copy) < 0) {
            return -1;
        }
    }
    else {
        int fresh = current == Py_None;
        if (fresh) {
            current = PyList_New(n);
            if (current == NULL) {
                return -1;
            }
            for (Py_ssize_t i = 0; i < n; i++) {
                PyList_SET_ITEM(current, i, Py_NewRef(radix_absent_page));
            }
            radix_untrack_leaf(current);
        }
        else {
            Py_INCREF(current);
        }
        int err = 0;
        for (Py_ssize_t i = 0; !err && i < at;
             i++) { /* every slot checked before any is written */
            PyObject *off = PySequence_Fast_GET_ITEM(offsets, i);
            PyObject *was = PyObject_GetItem(current, off);
            int absent = was ? radix_is_absent(was) : -1;
            Py_XDECREF(was);
            if (absent == 0) {
                radix_fail_assert(Py_BuildValue("(OOOO)", node, tier, pool, off));
            }
            err = absent <= 0;
        }
        for (Py_ssize_t i = 0; !err && i < at && i < given; i++) {
            err = PyObject_SetItem(current, PySequence_Fast_GET_ITEM(offsets, i),
                                   PySequence_Fast_GET_ITEM(pages, i)) < 0;
        }
        if (!err && fresh) {
            err = PyList_SetItem(row, p, Py_NewRef(current)) < 0;
        }
        Py_DECREF(current);
        if (err) {
            return -1;
        }
    }
    return radix_count(node, t, p, given, owned, protected);
}

/* set_pages(node, tier, pool, offsets, pages, owned, protected) */
static PyObject *
set_pages(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(7, "set_pages");
    Node *node = radix_as_node(args[0]);
    Py_ssize_t t, p;
    /* The arguments first (iterating or indexing them may run Python code), the node's
     * state after: nothing between reading it and writing it runs any. */
    PyObject *offsets = node ? PySequence_Fast(args[3], "offsets must be a sequence") : NULL;
    PyObject *pages = offsets ? PySequence_Fast(args[4], "pages must be a sequence") : NULL;
    int ints =
        pages && radix_all_ints(offsets, "offsets") == 0 && radix_all_ints(pages, "pages") == 0;
    PyObject *row = ints ? radix_slot_row(node, args[1], args[2], &t, &p) : NULL;
    int err = row == NULL || radix_give_pages(node, row, t, p, args[1], args[2], offsets, pages,
                                              args[5], args[6]) < 0;
    Py_XDECREF(offsets);
    Py_XDECREF(pages);
    if (err) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Empties node's slots[t][pool] (`row`) at `offsets` (any sequence; `tier`, `pool` and
 * `offsets` as given, for errors), uncounting them: clear_pages without the argument
 * parsing. Returns the pages it emptied, or NULL with an error set. */
PyObject *
radix_take_pages(Node *node, PyObject *row, Py_ssize_t t, Py_ssize_t p, PyObject *tier,
                 PyObject *pool, PyObject *offsets_in, PyObject *owned, PyObject *protected)
{
    PyObject *current = PyList_GET_ITEM(row, p);
    if (current == Py_None) {
        radix_fail_assert(Py_BuildValue("(OOO)", node, tier, pool));
        return NULL;
    }
    Py_INCREF(current);
    PyObject *offsets = PySequence_Fast(offsets_in, "offsets must be a sequence");
    if (offsets != NULL && radix_all_ints(offsets, "offsets") < 0) {
        Py_CLEAR(offsets);
    }
    Py_ssize_t at = offsets ? PySequence_Fast_GET_SIZE(offsets) : 0, i, left;
    PyObject *pages = offsets ? PyList_New(at) : NULL;
    for (i = 0; pages && i < at; i++) {
        PyObject *page = PyObject_GetItem(current, PySequence_Fast_GET_ITEM(offsets, i));
        if (page == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(pages, i, page);
    }
    for (i = 0; pages && i < at; i++) { /* after every read, as the reference */
        int absent = radix_is_absent(PyList_GET_ITEM(pages, i));
        if (absent) {
            if (absent > 0) {
                radix_fail_assert(Py_BuildValue("(OOOO)", node, tier, pool, offsets_in));
            }
            goto fail;
        }
    }
    for (i = 0; pages && i < at; i++) {
        if (PyObject_SetItem(current, PySequence_Fast_GET_ITEM(offsets, i), radix_absent_page) <
            0) {
            goto fail;
        }
    }
    if (pages == NULL || (left = radix_held(current)) < 0) {
        goto fail;
    }
    if (left == 0 && PyList_SetItem(row, p, Py_NewRef(Py_None)) < 0) {
        goto fail;
    }
    if (radix_count(node, t, p, -at, owned, protected) < 0) {
        goto fail;
    }
    Py_DECREF(current);
    Py_DECREF(offsets);
    return pages;
fail:
    Py_DECREF(current);
    Py_XDECREF(offsets);
    Py_XDECREF(pages);
    return NULL;
}

/* clear_pages(node, tier, pool, offsets, owned, protected) -> the pages it emptied */
static PyObject *
clear_pages(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(6, "clear_pages");
    Node *node = radix_as_node(args[0]);
    Py_ssize_t t, p;
    PyObject *offsets = node ? PySequence_Fast(args[3], "offsets must be a sequence") : NULL;
    int ints = offsets && radix_all_ints(offsets, "offsets") == 0;
    PyObject *row = ints ? radix_slot_row(node, args[1], args[2], &t, &p) : NULL;
    PyObject *out =
        row ? radix_take_pages(node, row, t, p, args[1], args[2], offsets, args[4], args[5])
            : NULL;
    Py_XDECREF(offsets);
    return out;
}

/* lock(nodes, pool, delta, protected): add delta to each node's lock on pool */
static PyObject *
lock(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(4, "lock");
    Py_ssize_t at = radix_as_index(args[1]);
    if (at == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyLong_CheckExact(args[2])) {
        return PyErr_Format(PyExc_TypeError, "a lock's delta must be an int");
    }
    long long delta = PyLong_AsLongLong(args[2]);
    PyObject *nodes =
        PyErr_Occurred() ? NULL : PySequence_Fast(args[0], "nodes must be a sequence");
    if (nodes == NULL) {
        return NULL;
    }
    /* Checked before any change: a pool out of range, and the page lists a lock that
     * comes or goes will count (lists of ints: counting them runs no Python code). */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(nodes); i++) {
        Node *node = radix_as_node(PySequence_Fast_GET_ITEM(nodes, i));
        Py_ssize_t before = node ? radix_lock_of(node, at) : -1;
        if (before < 0) {
            goto fail;
        }
        if ((before == 0) == (before + delta == 0)) {
            continue;
        }
        for (Py_ssize_t t = 0; t < PyList_GET_SIZE(node->slots); t++) {
            PyObject *row = radix_slot_row_at(node, t, at);
            PyObject *pages = row ? PyList_GET_ITEM(row, at) : NULL;
            if (pages == NULL || (pages != Py_None && radix_held(pages) < 0)) {
                goto fail;
            }
        }
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(nodes); i++) {
        Node *node = (Node *)PySequence_Fast_GET_ITEM(nodes, i);
        Py_ssize_t was = radix_lock_of(node, at);
        long long before = was, after = before + delta;
        if (was < 0) {
            goto fail;
        }
        if (after < 0) {
            PyErr_Format(PyExc_RuntimeError, "unlock of an unlocked node: %S", (PyObject *)node);
            goto fail;
        }
        PyObject *now = PyLong_FromLongLong(after);
        if (now == NULL || PySequence_SetItem(node->locks, at, now) < 0) {
            Py_XDECREF(now);
            goto fail;
        }
        Py_DECREF(now);
        if ((before == 0) == (after == 0)) {
            continue;
        }
        for (Py_ssize_t t = 0; t < PyList_GET_SIZE(node->slots); t++) {
            PyObject *row = radix_node_tier(node, t);
            PyObject *pages = row ? PySequence_GetItem(row, at) : NULL;
            Py_ssize_t h = pages == NULL ? -1 : pages == Py_None ? 0 : radix_held(pages);
            Py_XDECREF(pages);
            if (h < 0 || (h && radix_add(args[3], t, at, after ? h : -h) < 0)) {
                goto fail;
            }
        }
    }
    Py_DECREF(nodes);
    Py_RETURN_NONE;
fail:
    Py_DECREF(nodes);
    return NULL;
}

/* A module function by its Python name and its C function. */
#define FAST(NAME, FN, DOC) {NAME, (PyCFunction)(void (*)(void))FN, METH_FASTCALL, DOC}

static PyMethodDef functions[] = {
    FAST("walk", radix_walk, "walk(roots, root_key, raw, step) -> (path, pages matched)"),
    FAST("walk_keys", radix_walk_keys, "walk_keys(by_first_key, keys) -> (path, pages matched)"),
    FAST("touch", radix_touch, "touch(nodes, now, hit)"),
    FAST("attach", radix_attach,
         "attach(parent, keys, tokens, step, by_first_key, clock) -> node"),
    FAST("split", radix_split, "split(node, k, step, by_first_key) -> head"),
    FAST("set_pages", set_pages, "set_pages(node, tier, pool, offsets, pages, owned, protected)"),
    FAST("clear_pages", clear_pages,
         "clear_pages(node, tier, pool, offsets, owned, protected) -> pages"),
    FAST("lock", lock, "lock(nodes, pool, delta, protected)"),
    FAST("missing", radix_missing,
         "missing(path, positions, pool, tiers) -> positions without a page"),
    FAST("place_runs", radix_place_runs,
         "place_runs(nodes, tier, placements, owned, protected) -> given"),
    FAST("grow", radix_grow,
         "grow(path, parent, keys, tokens, step, tier, placements, by_first_key, owned, "
         "protected, clock) -> (nodes, given)"),
    {NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_radix",
    .m_doc = "The radix tree's nodes and hot primitives in C.",
    .m_size = -1,
    .m_methods = functions,
};

PyMODINIT_FUNC
PyInit__radix(void)
{
    if (PyType_Ready(&radix_NodeType) < 0 || PyType_Ready(&radix_TreeStateType) < 0) {
        return NULL;
    }
    radix_absent_page = PyLong_FromLong(-1), radix_zero = PyLong_FromLong(0);
    PyObject *m = radix_absent_page && radix_zero ? PyModule_Create(&module) : NULL;
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "TreeNode", (PyObject *)&radix_NodeType) < 0 ||
        PyModule_AddObjectRef(m, "TreeState", (PyObject *)&radix_TreeStateType) < 0 ||
        PyModule_AddFunctions(m, radix_node_functions) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
