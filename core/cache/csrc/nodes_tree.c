/* The radix tree's hot primitives over C TreeNodes: the `_radix` module. Each function
 * does what its namesake in core/cache/nodes.py does, in the same order (so a failed
 * assertion leaves the same state); RadixTree keeps the journal and change log. */
#include "nodes.h"
#include <string.h>

Node *
radix_as_node(PyObject *o)
{
    if (!IS_NODE(o)) {
        PyErr_Format(PyExc_TypeError, "expected a native TreeNode, got %.80s",
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    Node *node = (Node *)o;
    if (node->keys == NULL) {
        PyErr_SetString(PyExc_AttributeError, "TreeNode was cleared");
        return NULL;
    }
    return node;
}

Py_ssize_t
radix_as_index(PyObject *o)
{
    return PyNumber_AsSsize_t(o, PyExc_IndexError);
}

void
radix_fail_assert(PyObject *why)
{
    PyObject *args = why ? PyTuple_Pack(1, why) : NULL;
    if (args) {
        PyErr_SetObject(PyExc_AssertionError, args);
    }
    Py_XDECREF(args);
    Py_XDECREF(why);
}

/* bytes[lo:hi], clamped as Python slices are. */
static PyObject *
cut(PyObject *bytes, Py_ssize_t lo, Py_ssize_t hi)
{
    Py_ssize_t n = PyBytes_GET_SIZE(bytes);
    lo = lo > n ? n : lo, hi = hi > n ? n : hi;
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(bytes) + lo, hi > lo ? hi - lo : 0);
}

/* grid[t][p] += delta, for the tree's [tier][pool] counters. */
int
radix_add(PyObject *grid, Py_ssize_t t, Py_ssize_t p, Py_ssize_t delta)
{
    /* t and p are checked: a negative one would wrap, as a Python index does */
    PyObject *row = PyList_Check(grid) && t >= 0 ? PySequence_GetItem(grid, t) : NULL;
    if (row == NULL || !PyList_Check(row) || p < 0 || p >= PyList_GET_SIZE(row)) {
        Py_XDECREF(row);
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "counters must be [tier][pool] lists");
        }
        return -1;
    }
    PyObject *step = PyLong_FromSsize_t(delta);
    PyObject *sum = step ? PyNumber_Add(PyList_GET_ITEM(row, p), step) : NULL;
    Py_XDECREF(step);
    int r = sum ? PyList_SetItem(row, p, sum) : -1;
    Py_DECREF(row);
    return r;
}

/* How many pages of a page list are held (not ABSENT); -1 on error. */
Py_ssize_t
radix_held(PyObject *pages)
{
    if (!PyList_CheckExact(pages)) {
        PyErr_SetString(PyExc_TypeError, "page lists must be lists");
        return -1;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pages); i++) { /* is_absent runs no Python */
        int a = radix_is_absent(PyList_GET_ITEM(pages, i));
        if (a < 0) {
            return -1;
        }
        count += !a;
    }
    return count;
}

Py_ssize_t
radix_lock_of(Node *node, Py_ssize_t p)
{
    if (p < 0 || p >= PyList_GET_SIZE(node->locks)) {
        PyErr_Format(PyExc_IndexError, "no pool %zd in a TreeNode's locks", p);
        return -1;
    }
    PyObject *lock = PyList_GET_ITEM(node->locks, p);
    Py_ssize_t n = PyLong_CheckExact(lock) ? PyLong_AsSsize_t(lock) : -1;
    if (n < 0 && !PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "locks must be ints >= 0, got %R", lock);
    }
    return n;
}

/* The owned/protected counters follow `delta` pages given to or taken from a node. */
int
radix_count(Node *node, Py_ssize_t t, Py_ssize_t p, Py_ssize_t delta, PyObject *owned,
            PyObject *protected)
{
    if (radix_add(owned, t, p, delta) < 0) {
        return -1;
    }
    Py_ssize_t locked = radix_lock_of(node, p);
    return locked < 0 ? -1 : locked ? radix_add(protected, t, p, delta) : 0;
}

/* walk(roots, root_key, raw, step) -> (path, pages matched) */
PyObject *
radix_walk(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(4, "walk");
    Py_ssize_t step = PyLong_AsSsize_t(args[3]);
    if (step == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return radix_walk_from(args[0], args[1], args[2], step);
}

/* walk's work, for the module function and the tree's own method (radix.c). */
PyObject *
radix_walk_from(PyObject *roots, PyObject *root_key, PyObject *raw, Py_ssize_t step)
{
    if (roots == NULL || !PyDict_Check(roots) || !PyBytes_Check(raw) || step <= 0) {
        return PyErr_Format(PyExc_TypeError, "walk(dict, key, bytes, step > 0)");
    }
    const char *buf = PyBytes_AS_STRING(raw);
    Py_ssize_t len = PyBytes_GET_SIZE(raw), end = len - len % step, off = 0, matched = -1;
    PyObject *path = PyList_New(0), *node = PyDict_GetItemWithError(roots, root_key);
    while (path && node && off < end) {
        if (radix_as_node(node) == NULL) {
            goto fail;
        }
        PyObject *first = PyBytes_FromStringAndSize(buf + off, step);
        if (first == NULL) {
            goto fail;
        }
        node = PyDict_GetItemWithError(((Node *)node)->children, first);
        Py_DECREF(first);
        if (node == NULL) {
            break;
        }
        Node *n = radix_as_node(node);
        if (n == NULL || PyList_Append(path, node) < 0) {
            goto fail;
        }
        const char *tok = PyBytes_AS_STRING(n->tokens);
        Py_ssize_t tl = PyBytes_GET_SIZE(n->tokens);
        if (off + tl <= len &&
            memcmp(buf + off, tok, tl) == 0) { /* in place: no copy of the run */
            off += tl;
            continue;
        }
        Py_ssize_t k = 1;
        while (off + (k + 1) * step <= end && (k + 1) * step <= tl &&
               memcmp(buf + off + k * step, tok + k * step, step) == 0) {
            k++;
        }
        matched = n->start + k;
        break;
    }
    if (path == NULL || PyErr_Occurred()) {
        goto fail;
    }
    return Py_BuildValue("(Nn)", path, matched >= 0 ? matched : off / step);
fail:
    Py_XDECREF(path);
    return NULL;
}

/* walk_keys(by_first_key, keys) -> (path, pages matched): node by node, each found by its
 * first page's key (the map holds no other) and its further keys compared in place. */
PyObject *
radix_walk_keys(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(2, "walk_keys");
    if (!PyDict_Check(args[0])) {
        return PyErr_Format(PyExc_TypeError, "walk_keys(dict, keys)");
    }
    PyObject *keys = PySequence_Fast(args[1], "keys must be a sequence");
    PyObject *path = keys ? PyList_New(0) : NULL;
    if (path == NULL) {
        goto fail;
    }
    Py_ssize_t total = PySequence_Fast_GET_SIZE(keys), i = 0;
    /* bytes only, the chain's and the nodes': their compares and hashes run no Python
     * code, which could replace a node's keys under the loop */
    for (Py_ssize_t x = 0; x < total; x++) {
        if (!PyBytes_CheckExact(PySequence_Fast_GET_ITEM(keys, x))) {
            PyErr_SetString(PyExc_TypeError, "keys must be bytes");
            goto fail;
        }
    }
    PyObject *tail = NULL; /* the last node on the path, borrowed from it */
    while (i < total) {
        PyObject *found = PyDict_GetItemWithError(args[0], PySequence_Fast_GET_ITEM(keys, i));
        if (found == NULL) {
            break;
        }
        Node *node = radix_as_node(found);
        Py_ssize_t n = node ? radix_node_n(node) : -1;
        if (n < 0) {
            goto fail;
        }
        if (tail == NULL && node->parent == Py_None) {
            PyErr_SetString(PyExc_AssertionError, "a namespace root has no parent");
            goto fail;
        }
        /* the first node hangs below a root, each next one below the last (so it starts at i) */
        if (tail ? node->parent != tail : ((Node *)node->parent)->parent != Py_None) {
            break;
        }
        if (PyList_Append(path, (PyObject *)node) < 0) {
            goto fail;
        }
        tail = (PyObject *)node;
        Py_ssize_t j = 1;
        for (; j < n && j < PyList_GET_SIZE(node->keys) && i + j < total; j++) {
            PyObject *mine = PyList_GET_ITEM(node->keys, j),
                     *theirs = PySequence_Fast_GET_ITEM(keys, i + j);
            if (!PyBytes_CheckExact(mine)) {
                PyErr_SetString(PyExc_TypeError, "keys must be bytes");
                goto fail;
            }
            if (PyBytes_GET_SIZE(mine) != PyBytes_GET_SIZE(theirs) ||
                memcmp(PyBytes_AS_STRING(mine), PyBytes_AS_STRING(theirs),
                       PyBytes_GET_SIZE(mine))) {
                break;
            }
        }
        i += j;
        if (j < n) {
            break;
        }
    }
    if (PyErr_Occurred()) {
        goto fail;
    }
    Py_DECREF(keys);
    return Py_BuildValue("(Nn)", path, i);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(path);
    return NULL;
}

/* touch(nodes, now, hit): each node's last access is `now`; a hit counts one. */
PyObject *
radix_touch(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(3, "touch");
    long long now = PyLong_AsLongLong(args[1]);
    int hit = PyObject_IsTrue(args[2]);
    PyObject *nodes = PySequence_Fast(args[0], "nodes must be a sequence");
    if ((now == -1 && PyErr_Occurred()) || hit < 0 || nodes == NULL) {
        Py_XDECREF(nodes);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(nodes); i++) {
        Node *node = radix_as_node(PySequence_Fast_GET_ITEM(nodes, i));
        if (node == NULL) {
            Py_DECREF(nodes);
            return NULL;
        }
        node->last_access = now;
        node->hits += hit;
    }
    Py_DECREF(nodes);
    Py_RETURN_NONE;
}

Node *
radix_attach_node(Node *parent, PyObject *keys, PyObject *tokens, Py_ssize_t step,
                  PyObject *by_first_key, long long clock)
{
    if (!PyList_Check(keys) || PyList_GET_SIZE(keys) == 0 || !PyBytes_Check(tokens) ||
        !PyDict_Check(by_first_key) || step <= 0) {
        PyErr_SetString(PyExc_TypeError,
                        "attach(node, non-empty list, bytes, step > 0, dict, clock)");
        return NULL;
    }
    Node *node = radix_node_new(keys, tokens, (PyObject *)parent, parent->end);
    if (node == NULL) {
        return NULL;
    }
    node->last_access = clock;
    /* Owned across the calls below: hashing a key runs Python code, which may change the
     * caller's list, and a child it replaces must outlive the dict's hold on it. */
    PyObject *first = cut(tokens, 0, step);
    PyObject *key = Py_NewRef(PyList_GET_ITEM(keys, 0));
    PyObject *before = first ? PyDict_GetItemWithError(parent->children, first) : NULL;
    Py_XINCREF(before);
    int err = first == NULL || PyErr_Occurred() ||
              PyDict_SetItem(parent->children, first, (PyObject *)node) < 0;
    if (!err && PyDict_SetItem(by_first_key, key, (PyObject *)node) < 0) {
        /* Whole or not at all: the parent's children as they were. Putting back or
         * deleting a key the dict holds (hashed already) neither allocates nor fails. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (before ? PyDict_SetItem(parent->children, first, before)
                   : PyDict_DelItem(parent->children, first)) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
        err = 1;
    }
    Py_XDECREF(before);
    Py_DECREF(key);
    Py_XDECREF(first);
    if (err) {
        Py_CLEAR(node);
    }
    return node;
}

/* attach(parent, keys, tokens, step, by_first_key, clock) -> the new child of `parent` */
PyObject *
radix_attach(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(6, "attach");
    Node *parent = radix_as_node(args[0]);
    Py_ssize_t step = PyLong_AsSsize_t(args[3]);
    long long clock = PyLong_AsLongLong(args[5]);
    if (parent == NULL || PyErr_Occurred()) {
        return NULL;
    }
    return (PyObject *)radix_attach_node(parent, args[1], args[2], step, args[4], clock);
}

static PyObject *
none_if_empty(PyObject *pages)
{
    Py_ssize_t n = pages ? radix_held(pages) : -1;
    if (n != 0) {
        return n < 0 ? (Py_XDECREF(pages), NULL) : pages;
    }
    Py_DECREF(pages);
    return Py_NewRef(Py_None);
}

/* 0 where every page list of `node` is a list of ints (or None): moving them runs no
 * Python code and cannot stop halfway; -1 with an error where one is not. */
static int
check_slots(Node *node)
{
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(node->slots); t++) {
        PyObject *row = radix_node_tier(node, t);
        if (row == NULL) {
            return -1;
        }
        for (Py_ssize_t p = 0; p < PyList_GET_SIZE(row); p++) {
            PyObject *pages = PyList_GET_ITEM(row, p);
            if (pages != Py_None && radix_held(pages) < 0) {
                return -1;
            }
        }
    }
    return 0;
}

/* Moves the first k pages of each of node's page lists to head's (check_slots first). */
static int
split_slots(Node *head, Node *node, Py_ssize_t k)
{
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(head->slots) && t < PyList_GET_SIZE(node->slots);
         t++) {
        PyObject *head_row = radix_node_tier(head, t), *row = radix_node_tier(node, t);
        if (head_row == NULL || row == NULL) {
            return -1;
        }
        for (Py_ssize_t p = 0; p < PyList_GET_SIZE(row); p++) {
            PyObject *pages = PyList_GET_ITEM(row, p);
            if (pages == Py_None) {
                continue;
            }
            if (!PyList_CheckExact(pages)) { /* its slicing could run Python code */
                PyErr_SetString(PyExc_TypeError, "page lists must be lists");
                return -1;
            }
            Py_INCREF(pages);
            PyObject *front = none_if_empty(radix_untrack_leaf(PySequence_GetSlice(pages, 0, k)));
            PyObject *back =
                none_if_empty(radix_untrack_leaf(PySequence_GetSlice(pages, k, PY_SSIZE_T_MAX)));
            Py_DECREF(pages);
            if (front == NULL || back == NULL || PySequence_SetItem(head_row, p, front) < 0 ||
                PyList_SetItem(row, p, back) < 0) {
                Py_XDECREF(front);
                return -1;
            }
            Py_DECREF(front);
        }
    }
    return 0;
}

/* split(node, k, step, by_first_key) -> the new head node holding node's first k pages */
PyObject *
radix_split(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(4, "split");
    Node *node = radix_as_node(args[0]);
    if (!PyLong_CheckExact(args[1])) {
        return PyErr_Format(PyExc_TypeError, "split needs an int count of pages");
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]), step = PyLong_AsSsize_t(args[2]);
    PyObject *by_first_key = args[3];
    if (node == NULL || PyErr_Occurred()) {
        return NULL;
    }
    if (!PyDict_Check(by_first_key) || step <= 0) {
        return PyErr_Format(PyExc_TypeError, "split(node, k, step > 0, dict)");
    }
    Py_ssize_t n = radix_node_n(node);
    if (!(0 < k && k < n)) {
        radix_fail_assert(Py_BuildValue("(On)", node, k));
        return NULL;
    }
    if (check_slots(node) < 0) {
        return NULL;
    }
    if (!PyBytes_CheckExact(PyList_GET_ITEM(node->keys, 0)) ||
        !PyBytes_CheckExact(PyList_GET_ITEM(node->keys, k))) {
        return PyErr_Format(PyExc_TypeError, "keys must be bytes"); /* hashed below: no Python */
    }
    PyObject *parent = node->parent, *tokens = node->tokens;
    PyObject *head_keys = PyList_GetSlice(node->keys, 0, k),
             *head_tokens = cut(tokens, 0, k * step);
    Node *head = head_keys && head_tokens
                     ? radix_node_new(head_keys, head_tokens, parent, node->start)
                     : NULL;
    Py_XDECREF(head_keys);
    Py_XDECREF(head_tokens);
    PyObject *locks = head ? radix_untrack_leaf(PySequence_List(node->locks)) : NULL;
    if (locks == NULL) {
        goto fail;
    }
    Py_SETREF(head->locks, locks);
    head->last_access = node->last_access, head->hits = node->hits;
    if (split_slots(head, node, k) < 0) {
        goto fail;
    }
    PyObject *first = cut(tokens, 0, step);
    if (first == NULL || PyDict_SetItem(((Node *)parent)->children, first, (PyObject *)head) < 0) {
        Py_XDECREF(first);
        goto fail;
    }
    Py_DECREF(first);
    PyObject *tail_keys = PyList_GetSlice(node->keys, k, n),
             *tail_tokens = cut(tokens, k * step, PY_SSIZE_T_MAX);
    if (tail_keys == NULL || tail_tokens == NULL) {
        Py_XDECREF(tail_keys);
        Py_XDECREF(tail_tokens);
        goto fail;
    }
    Py_SETREF(node->keys, radix_untrack_leaf(tail_keys));
    Py_SETREF(node->tokens, tail_tokens);
    node->start += k;
    Py_SETREF(node->parent, Py_NewRef((PyObject *)head));
    first = cut(node->tokens, 0, step);
    if (first == NULL || PyDict_SetItem(head->children, first, (PyObject *)node) < 0) {
        Py_XDECREF(first);
        goto fail;
    }
    Py_DECREF(first);
    if (PyDict_SetItem(by_first_key, PyList_GET_ITEM(head->keys, 0), (PyObject *)head) < 0 ||
        PyDict_SetItem(by_first_key, PyList_GET_ITEM(node->keys, 0), (PyObject *)node) < 0) {
        goto fail;
    }
    return (PyObject *)head;
fail:
    Py_XDECREF(head);
    return NULL;
}

/* Takes a node grow attached back out of `parent`'s children and `by_first_key`, where they
 * still map to it (code a placement ran may have moved it), keeping the error in flight. */
static void
unattach(Node *parent, Node *node, PyObject *first, PyObject *key, PyObject *by_first_key)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (PyDict_GetItemWithError(parent->children, first) == (PyObject *)node) {
        PyDict_DelItem(parent->children, first);
    }
    if (PyDict_GetItemWithError(by_first_key, key) == (PyObject *)node) {
        PyDict_DelItem(by_first_key, key);
    }
    PyErr_Clear(); /* the placement's error is the one raised */
    PyErr_Restore(type, value, tb);
}

/* grow's work once its arguments are checked (radix_grow_at). */
static PyObject *
grow_run(PyObject *path, Node *parent, PyObject *keys, PyObject *tokens, Py_ssize_t step,
         PyObject *tier, PyObject *placements, PyObject *by_first_key, PyObject *owned,
         PyObject *protected, long long clock)
{
    Py_ssize_t np = PyList_GET_SIZE(path), nk = PyList_GET_SIZE(keys);
    /* Everything that can fail for memory comes before the attach, but place_runs. */
    PyObject *nodes = PyList_New(np + (nk > 0)), *out = nodes ? PyTuple_New(2) : NULL;
    PyObject *first = out && nk ? cut(tokens, 0, step) : NULL;
    PyObject *key = nk ? Py_NewRef(PyList_GET_ITEM(keys, 0)) : NULL;
    Node *node = NULL;
    if (out == NULL || (nk && first == NULL)) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < np; i++) {
        PyList_SET_ITEM(nodes, i, Py_NewRef(PyList_GET_ITEM(path, i)));
    }
    if (nk) { /* attach's, with its first page's bytes cut once, for the undo too */
        node = radix_node_new(keys, tokens, (PyObject *)parent, parent->end);
        if (node == NULL) {
            goto fail;
        }
        node->last_access = clock;
        PyList_SET_ITEM(nodes, np, Py_NewRef((PyObject *)node));
        if (PyDict_SetItem(parent->children, first, (PyObject *)node) < 0 ||
            PyDict_SetItem(by_first_key, key, (PyObject *)node) < 0) {
            goto undo;
        }
    }
    PyObject *place_args[5] = {nodes, tier, placements, owned, protected};
    PyObject *given = radix_place_runs(NULL, place_args, 5);
    if (given == NULL) {
        goto undo;
    }
    PyTuple_SET_ITEM(out, 0, nodes);
    PyTuple_SET_ITEM(out, 1, given);
    Py_XDECREF(first);
    Py_XDECREF(key);
    Py_XDECREF(node);
    return out;
undo:
    if (node != NULL) {
        unattach(parent, node, first, key, by_first_key);
    }
fail:
    Py_XDECREF(nodes);
    Py_XDECREF(out);
    Py_XDECREF(first);
    Py_XDECREF(key);
    Py_XDECREF(node);
    return NULL;
}

/* grow(path, parent, keys, tokens, step, tier, placements, by_first_key, owned, protected,
 * clock) -> (nodes, given): `path`, then a new run of `keys` attached under `parent` (none
 * for no keys), and each placement's pages given to the nodes holding its positions
 * (place_runs); all or nothing, calling no Python method. `given` is place_runs': what
 * the journal takes back, before it detaches the new node (nodes[-1]). */
PyObject *
radix_grow(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(11, "grow");
    if (!PyLong_CheckExact(args[4]) || !PyLong_CheckExact(args[10])) {
        return PyErr_Format(PyExc_TypeError, "grow(list, parent, list, bytes, int, tier, "
                                             "placements, dict, owned, protected, int)");
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[4]);
    long long clock = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    return radix_grow_at(args[0], args[1], args[2], args[3], step, args[5], args[6], args[7],
                         args[8], args[9], clock);
}

/* grow() with its step and clock in C, for insert_free (radix_insert.c) too: the other
 * arguments are checked here, before any change. */
PyObject *
radix_grow_at(PyObject *path, PyObject *parent, PyObject *keys, PyObject *tokens, Py_ssize_t step,
              PyObject *tier, PyObject *placements, PyObject *by_first_key, PyObject *owned,
              PyObject *protected, long long clock)
{
    if (!PyList_CheckExact(path) || !PyList_CheckExact(keys) || !PyBytes_CheckExact(tokens) ||
        by_first_key == NULL || !PyDict_CheckExact(by_first_key)) {
        return PyErr_Format(PyExc_TypeError, "grow(list, parent, list, bytes, int, tier, "
                                             "placements, dict, owned, protected, int)");
    }
    if (step <= 0) {
        return PyErr_Format(PyExc_ValueError, "grow's step must be > 0");
    }
    Py_ssize_t nk = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < nk; i++) { /* hashed and kept: bytes run no Python code */
        if (!PyBytes_CheckExact(PyList_GET_ITEM(keys, i))) {
            return PyErr_Format(PyExc_TypeError, "keys must be bytes");
        }
    }
    Node *node = nk ? radix_as_node(parent) : NULL;
    if (nk && node == NULL) {
        return NULL;
    }
    return grow_run(path, node, keys, tokens, step, tier, placements, by_first_key, owned,
                    protected, clock);
}
