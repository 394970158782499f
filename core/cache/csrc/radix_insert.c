/* RadixTree.insert_free (radix.py) as one C call: an insert on free pages, whole or not at
 * all. The Python method stays the reference; this does what it does in the same order
 * (RadixTree.root, new_run, _grow over the grow kernel, _ungrow's clear_pages and detach),
 * so any failure leaves the same state. Its undo is what the grow kernel gave and the node
 * it attached; its pages wait in `got` until the tree owns them. */
#include "nodes.h"

static PyObject *S_free_count, *S_alloc, *S_free, *S_chain, *S_root, *S_touched, *S_left;

static int
intern_names(void)
{
    if (S_left != NULL) {
        return 0;
    }
    S_free_count = PyUnicode_InternFromString("free_count");
    S_alloc = PyUnicode_InternFromString("alloc");
    S_free = PyUnicode_InternFromString("free");
    S_chain = PyUnicode_InternFromString("chain");
    S_root = PyUnicode_InternFromString("root");
    S_touched = PyUnicode_InternFromString("touched");
    S_left = S_touched ? PyUnicode_InternFromString("left") : NULL;
    return S_left == NULL ? -1 : 0;
}

/* obj.name(a[, b]) -> new reference, or NULL with an error. */
static PyObject *
call(PyObject *obj, PyObject *name, PyObject *a, PyObject *b)
{
    PyObject *args[3] = {obj, a, b};
    return PyObject_VectorcallMethod(name, args, b ? 3 : 2, NULL);
}

static int
call_none(PyObject *obj, PyObject *name, PyObject *a, PyObject *b)
{
    PyObject *out = call(obj, name, a, b);
    Py_XDECREF(out);
    return out == NULL ? -1 : 0;
}

static int
has(PyObject *field)
{
    return field != NULL && field != Py_None;
}

static PyObject *
or_none(PyObject *field)
{
    return field == NULL ? Py_None : field;
}

/* tree.dirty gets `a` (and `b`), as at every mutation, when it is tracked. */
static int
mark(TreeState *tree, PyObject *a, PyObject *b)
{
    if (!has(tree->dirty)) {
        return 0;
    }
    if (!PySet_Check(tree->dirty)) {
        PyErr_SetString(PyExc_TypeError, "RadixTree.dirty must be a set or None");
        return -1;
    }
    if (PySet_Add(tree->dirty, a) < 0) {
        return -1;
    }
    return b == NULL ? 0 : PySet_Add(tree->dirty, b);
}

/* tree.changes.touched(node, offsets), with events on. */
static int
touched(TreeState *tree, Node *node, PyObject *offsets)
{
    return has(tree->changes) ? call_none(tree->changes, S_touched, (PyObject *)node, offsets) : 0;
}

/* RadixTree.root: the namespace's root, made where there is none (borrowed). */
static Node *
root(TreeState *tree, PyObject *root_key)
{
    PyObject *found = PyDict_GetItemWithError(tree->roots, root_key);
    if (found != NULL) {
        return radix_as_node(found);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *keys = PyList_New(1), *empty = PyBytes_FromStringAndSize(NULL, 0);
    Node *node = NULL;
    if (keys != NULL && empty != NULL) {
        PyList_SET_ITEM(keys, 0, Py_NewRef(root_key));
        node = radix_node_new(keys, empty, Py_None, 0);
    }
    Py_XDECREF(keys);
    Py_XDECREF(empty);
    int err = node == NULL || PyDict_SetItem(tree->roots, root_key, (PyObject *)node) < 0;
    Py_XDECREF(node); /* the dict holds it */
    return err ? NULL : node;
}

/* A failed grow: the namespace root `parent`, left without children, goes, as RadixTree.detach
 * would take it (RadixTree._grow). Keeps the error in flight. */
static void
drop_empty_root(TreeState *tree, Node *parent)
{
    if (parent == NULL || parent->parent != Py_None || PyDict_GET_SIZE(parent->children) ||
        PyList_GET_SIZE(parent->keys) == 0) {
        return;
    }
    PyObject *type, *value, *tb, *key = PyList_GET_ITEM(parent->keys, 0);
    PyErr_Fetch(&type, &value, &tb);
    Py_INCREF(key);
    if (PyDict_GetItemWithError(tree->roots, key) == (PyObject *)parent) {
        PyDict_DelItem(tree->roots, key);
    }
    Py_DECREF(key);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* RadixTree.detach with no journal, of a node just attached (no children, no pages). */
static int
detach(TreeState *tree, Node *node)
{
    Node *parent = (Node *)node->parent;
    Py_ssize_t n = radix_node_n(node);
    Py_ssize_t size = PyBytes_GET_SIZE(node->tokens); /* tokens[:page_bytes], clamped */
    PyObject *first = PyBytes_FromStringAndSize(PyBytes_AS_STRING(node->tokens),
                                                size < tree->page_bytes ? size : tree->page_bytes);
    int err = first == NULL || PyDict_DelItem(parent->children, first) < 0 ||
              PyDict_DelItem(tree->by_first_key, PyList_GET_ITEM(node->keys, 0)) < 0;
    Py_XDECREF(first);
    if (err) {
        return -1;
    }
    tree->node_count--;
    tree->page_count -= n;
    tree->version++;
    if (parent->parent == Py_None && PyDict_GET_SIZE(parent->children) == 0 &&
        PyDict_DelItem(tree->roots, PyList_GET_ITEM(parent->keys, 0)) < 0) {
        return -1;
    }
    if (mark(tree, (PyObject *)node, (PyObject *)parent) < 0) {
        return -1;
    }
    if (has(tree->dirty) && PySet_GET_SIZE(tree->dirty) > 2 * tree->node_count + 1024) {
        Py_SETREF(tree->dirty, Py_NewRef(Py_None)); /* untaken for long: stop holding nodes */
    }
    return has(tree->changes) ? call_none(tree->changes, S_left, (PyObject *)node, NULL) : 0;
}

/* grow's undo: each (node, pool, offsets) given taken back, newest first (clear_pages),
 * then the new node detached. Keeps the error that called for it. */
static void
undo(TreeState *tree, PyObject *tier, PyObject *given, Node *node)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int err = 0;
    for (Py_ssize_t k = given ? PyList_GET_SIZE(given) - 1 : -1; !err && k >= 0; k--) {
        PyObject *rec = PyList_GET_ITEM(given, k), *pool = PyTuple_GET_ITEM(rec, 1);
        Node *at = (Node *)PyTuple_GET_ITEM(rec, 0);
        PyObject *offsets = PyTuple_GET_ITEM(rec, 2), *row = NULL, *pages = NULL;
        Py_ssize_t t, p;
        err = mark(tree, (PyObject *)at, NULL) < 0 ||
              (row = radix_slot_row(at, tier, pool, &t, &p)) == NULL ||
              (pages = radix_take_pages(at, row, t, p, tier, pool, offsets, tree->owned,
                                        tree->protected)) == NULL ||
              touched(tree, at, offsets) < 0;
        Py_XDECREF(pages);
    }
    if (!err && node != NULL) {
        err = detach(tree, node) < 0;
    }
    if (err) { /* as in Python, an undo that fails raises its own error */
        Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
        return;
    }
    PyErr_Restore(type, value, tb);
}

/* PyDict_Next over `todo` as a Python loop over todo.items() goes: each (pool,
 * positions) held while Python code runs (an allocator's property, the hook: it may
 * replace the very list), and a dict whose size changed meanwhile an error, as there. */
static int
todo_next(PyObject *todo, Py_ssize_t size, Py_ssize_t *at, PyObject **pool, PyObject **positions)
{
    if (PyDict_GET_SIZE(todo) != size) {
        PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
        return -1;
    }
    if (!PyDict_Next(todo, at, pool, positions)) {
        return 0;
    }
    Py_INCREF(*pool), Py_INCREF(*positions);
    return 1;
}

/* Whether every allocator has the free pages `todo` asks of it: 1, 0, or -1 on error. */
static int
fits(PyObject *todo, PyObject *allocators)
{
    Py_ssize_t at = 0, size = PyDict_GET_SIZE(todo);
    PyObject *pool, *positions;
    int more = 0, room = 1;
    while (room == 1 && (more = todo_next(todo, size, &at, &pool, &positions)) > 0) {
        PyObject *alloc = PyDict_GetItemWithError(allocators, pool);
        if (alloc == NULL && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, pool);
        }
        PyObject *count = alloc ? PyObject_GetAttr(alloc, S_free_count) : NULL;
        Py_ssize_t free = count ? PyLong_AsSsize_t(count) : -1;
        Py_XDECREF(count);
        Py_ssize_t want = free == -1 && PyErr_Occurred() ? -1 : PyObject_Length(positions);
        room = want < 0 ? -1 : free >= want;
        Py_DECREF(pool), Py_DECREF(positions);
    }
    return more < 0 ? -1 : room;
}

/* Each pool's pages into got[(pool, tier)], the hook called first where it asks any. */
static int
take(PyObject *todo, PyObject *tier, PyObject *allocators, PyObject *hook, PyObject *got)
{
    Py_ssize_t at = 0, size = PyDict_GET_SIZE(todo);
    PyObject *pool, *positions;
    int more = 0, err = 0;
    while (!err && (more = todo_next(todo, size, &at, &pool, &positions)) > 0) {
        int any = hook == Py_None ? 0 : PyObject_IsTrue(positions);
        PyObject *out = any > 0 ? PyObject_CallFunctionObjArgs(hook, pool, tier, NULL) : NULL;
        err = any < 0 || (any > 0 && out == NULL);
        Py_XDECREF(out);
        PyObject *alloc = err ? NULL : PyDict_GetItemWithError(allocators, pool);
        Py_ssize_t want = alloc ? PyObject_Length(positions) : -1;
        PyObject *n = want >= 0 ? PyLong_FromSsize_t(want) : NULL;
        PyObject *pages = n ? call(alloc, S_alloc, n, NULL) : NULL;
        PyObject *key = pages ? PyTuple_Pack(2, pool, tier) : NULL;
        err = err || key == NULL || PyDict_SetItem(got, key, pages) < 0;
        Py_XDECREF(n), Py_XDECREF(pages), Py_XDECREF(key);
        if (err && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, pool);
        }
        Py_DECREF(pool), Py_DECREF(positions);
    }
    return err || more < 0 ? -1 : 0;
}

/* The finally: pages left in `got` back to their allocators (primitives.free_all). A free
 * that fails keeps no other pool's pages from theirs; the first error raises once every
 * free was tried, in place of the error in flight, as a Python finally does. */
static int
free_left(PyObject *got, PyObject *allocators)
{
    Py_ssize_t at = 0;
    PyObject *key, *pages, *type = NULL, *value = NULL, *tb = NULL;
    while (PyDict_Next(got, &at, &key, &pages)) {
        PyObject *alloc = PyTuple_Check(key) && PyTuple_GET_SIZE(key) == 2
                              ? PyDict_GetItemWithError(allocators, PyTuple_GET_ITEM(key, 0))
                              : NULL;
        if (alloc == NULL && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        if (alloc != NULL && call_none(alloc, S_free, pages, NULL) == 0) {
            continue;
        }
        if (type == NULL) {
            PyErr_Fetch(&type, &value, &tb);
        }
        else {
            PyErr_Clear();
        }
    }
    if (type == NULL) {
        return 0;
    }
    PyErr_Restore(type, value, tb);
    return -1;
}

/* The new run's parent and keys (new references: the keyer's chain, Python code, could
 * drop the caller's last reference to the parent), as RadixTree.new_run. */
static Node *
new_run(TreeState *tree, PyObject *path, PyObject *tokens, PyObject *keyer, PyObject **keys)
{
    Py_ssize_t np = PyList_GET_SIZE(path);
    Node *parent;
    if (np) {
        parent = radix_as_node(PyList_GET_ITEM(path, np - 1));
    }
    else {
        PyObject *root_key = PyObject_GetAttr(keyer, S_root);
        parent = root_key ? root(tree, root_key) : NULL;
        Py_XDECREF(root_key);
    }
    if (parent == NULL) {
        return NULL;
    }
    Py_ssize_t nk = PyList_GET_SIZE(parent->keys);
    if (nk == 0) {
        PyErr_SetString(PyExc_IndexError, "a node without keys");
        return NULL;
    }
    Py_INCREF(parent);
    PyObject *last = Py_NewRef(PyList_GET_ITEM(parent->keys, nk - 1));
    *keys = call(keyer, S_chain, tokens, last);
    Py_DECREF(last);
    if (*keys == NULL) {
        Py_CLEAR(parent);
    }
    return parent;
}

/* RadixTree._grow(path, parent, keys, tokens, tier, placements, touch=True): the grow
 * kernel, then the counts, the dirty set and the change log, then the touch; all or nothing.
 * (nodes, None), or NULL with an error and the tree as it was. `keys` and `parent` may be
 * NULL (no tokens: no run). */
static PyObject *
grow(TreeState *tree, PyObject *path, Node *parent, PyObject *keys, PyObject *tokens,
     PyObject *tier, PyObject *placements)
{
    long long now = tree->clock + 1;
    PyObject *none = keys ? NULL : PyList_New(0), *result = NULL;
    if (keys == NULL && none == NULL) {
        return NULL;
    }
    PyObject *grown = radix_grow_at(path, parent ? (PyObject *)parent : Py_None,
                                    keys ? keys : none, tokens, tree->page_bytes, tier, placements,
                                    tree->by_first_key, tree->owned, tree->protected, now);
    if (grown == NULL) {
        if (keys != NULL && PyList_CheckExact(keys) && PyList_GET_SIZE(keys)) {
            drop_empty_root(tree, parent);
        }
        goto done;
    }
    PyObject *nodes = PyTuple_GET_ITEM(grown, 0), *given = PyTuple_GET_ITEM(grown, 1);
    Py_ssize_t nk = keys ? PyList_GET_SIZE(keys) : 0, nn = PyList_GET_SIZE(nodes);
    Node *node = nk ? (Node *)PyList_GET_ITEM(nodes, nn - 1) : NULL; /* held by `nodes` */
    if (node != NULL) {
        tree->node_count++;
        tree->page_count += nk;
        tree->version++;
    }
    int err = node != NULL && mark(tree, (PyObject *)node, (PyObject *)parent) < 0;
    for (Py_ssize_t k = 0; !err && k < nn; k++) { /* touch's */
        err = mark(tree, PyList_GET_ITEM(nodes, k), NULL) < 0;
    }
    for (Py_ssize_t k = 0; !err && k < PyList_GET_SIZE(given); k++) {
        err = mark(tree, PyTuple_GET_ITEM(PyList_GET_ITEM(given, k), 0), NULL) < 0;
    }
    if (!err && node != NULL && has(tree->changes)) { /* range(node.n), built only for a log */
        PyObject *all = PyObject_CallFunction((PyObject *)&PyRange_Type, "n", radix_node_n(node));
        err = all == NULL || touched(tree, node, all) < 0;
        Py_XDECREF(all);
    }
    for (Py_ssize_t k = 0; !err && k < PyList_GET_SIZE(given); k++) {
        PyObject *rec = PyList_GET_ITEM(given, k);
        err = touched(tree, (Node *)PyTuple_GET_ITEM(rec, 0), PyTuple_GET_ITEM(rec, 2)) < 0;
    }
    if (err) {
        undo(tree, tier, given, node);
        goto done;
    }
    tree->clock = now; /* last: nothing after it can fail */
    for (Py_ssize_t k = 0; k < nn; k++) {
        ((Node *)PyList_GET_ITEM(nodes, k))->last_access = now;
    }
    result = PyTuple_Pack(2, nodes, Py_None);
done:
    Py_XDECREF(none);
    Py_XDECREF(grown);
    return result;
}

/* insert_free(path, tokens, keyer, todo, tier, allocators, hook, fill, hold, got): see
 * RadixTree.insert_free. */
PyObject *
radix_insert_free(TreeState *tree, PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(10, "insert_free");
    PyObject *path = args[0], *tokens = args[1], *keyer = args[2], *todo = args[3],
             *tier = args[4];
    PyObject *allocators = args[5], *hook = args[6], *fill = args[7], *hold = args[8],
             *got = args[9];
    if (intern_names() < 0) {
        return NULL;
    }
    if (!PyList_Check(path) || !PyBytes_Check(tokens) || !PyDict_Check(todo) ||
        !PyDict_Check(allocators) || !PyDict_Check(got)) {
        return PyErr_Format(PyExc_TypeError, "insert_free(list, bytes, keyer, dict, tier, dict, "
                                             "hook, fill, hold, dict)");
    }
    if (!PyDict_Check(or_none(tree->roots)) || !PyDict_Check(or_none(tree->by_first_key)) ||
        !PyList_Check(or_none(tree->owned)) || !PyList_Check(or_none(tree->protected)) ||
        tree->page_bytes <= 0) {
        return PyErr_Format(PyExc_TypeError, "a RadixTree's roots and by_first_key must be dicts, "
                                             "its counters lists, its page_bytes > 0");
    }
    int room = fits(todo, allocators);
    if (room <= 0) {
        return room < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *result = NULL, *keys = NULL, *placements = NULL;
    Node *parent = NULL; /* where the new run hangs (held: the keyer's chain runs Python code) */
    if (take(todo, tier, allocators, hook, got) < 0) {
        goto done;
    }
    if (fill != Py_None) {
        PyObject *failed = PyObject_CallFunctionObjArgs(fill, got, hold, NULL);
        if (failed == NULL) {
            goto done;
        }
        if (failed != Py_None) {
            PyObject *none = PyList_New(0);
            result = none ? PyTuple_Pack(2, none, failed) : NULL;
            Py_XDECREF(none);
            Py_DECREF(failed);
            goto done;
        }
        Py_DECREF(failed);
    }
    if (PyBytes_GET_SIZE(tokens) && (parent = new_run(tree, path, tokens, keyer, &keys)) == NULL) {
        goto done;
    }
    placements = PyList_New(0);
    Py_ssize_t at = 0;
    PyObject *pool, *positions;
    while (placements && PyDict_Next(todo, &at, &pool, &positions)) {
        PyObject *key = PyTuple_Pack(2, pool, tier);
        PyObject *pages = key ? PyDict_GetItemWithError(got, key) : NULL;
        PyObject *placement = pages ? PyTuple_Pack(3, pool, positions, pages) : NULL;
        if (pages == NULL && key != NULL && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        if (placement == NULL || PyList_Append(placements, placement) < 0) {
            Py_CLEAR(placements);
        }
        Py_XDECREF(key), Py_XDECREF(placement);
    }
    if (placements == NULL) {
        goto done;
    }
    if ((result = grow(tree, path, parent, keys, tokens, tier, placements)) != NULL) {
        PyDict_Clear(got); /* placed: the tree owns them now */
    }
done:
    if (result == NULL) { /* the finally, with an error in flight */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (free_left(got, allocators) < 0) {
            Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
        }
        else {
            PyErr_Restore(type, value, tb);
        }
    }
    else if (free_left(got, allocators) < 0) {
        Py_CLEAR(result);
    }
    Py_XDECREF(keys);
    Py_XDECREF(placements);
    Py_XDECREF(parent);
    return result;
}
