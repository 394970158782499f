/* Page positions along a path of C TreeNodes: which positions lack a page (missing), and
 * placing an insert's pages on the nodes holding their positions (place_runs), as
 * core/cache/nodes.py's functions of the same names do, in the same order. */
#include "nodes.h"

/* n C integers, or NULL with a MemoryError where n of them cannot be: the size in bytes
 * would wrap (a range of 2**62 positions), or there is no such memory. */
static long long *
positions_alloc(Py_ssize_t n)
{
    if (n < 0 || (size_t)n > PY_SSIZE_T_MAX / sizeof(long long)) {
        return (long long *)PyErr_NoMemory();
    }
    long long *out = PyMem_Malloc(sizeof(long long) * (size_t)(n ? n : 1));
    return out == NULL ? (long long *)PyErr_NoMemory() : out;
}

/* Sorted positions as C integers (a PySequence_Fast `seq` of ints), or NULL with an error
 * set. Ints only: another type's __index__ would run Python code mid-primitive. */
static long long *
as_positions(PyObject *seq)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (radix_all_ints(seq, "positions") < 0) {
        return NULL;
    }
    long long *out = positions_alloc(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

/* bisect.bisect_left(at, x, lo, hi): the same search, so unsorted input gives the same answer. */
static Py_ssize_t
bisect_left(const long long *at, long long x, Py_ssize_t lo, Py_ssize_t hi)
{
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (at[mid] < x) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return lo;
}

/* 1 where `pages` (a list) holds no ABSENT, 0 where it does, -1 on error. */
static int
whole(PyObject *pages)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pages); i++) {
        int a = radix_is_absent(PyList_GET_ITEM(pages, i));
        if (a) {
            return a < 0 ? -1 : 0;
        }
    }
    return 1;
}

/* Sorted positions as C integers, *n of them: a range of step 1 from its first item and
 * its length (a put's full-attention positions: no list of them is built), any other
 * sequence item by item. NULL with an error set. */
static long long *
positions_of(PyObject *obj, Py_ssize_t *n)
{
    if (PyRange_Check(obj)) {
        Py_ssize_t len = PySequence_Length(obj);
        PyObject *first = len > 0 ? PySequence_GetItem(obj, 0) : NULL;
        PyObject *last = first ? PySequence_GetItem(obj, len - 1) : NULL;
        long long a = last ? PyLong_AsLongLong(first) : -1,
                  b = last ? PyLong_AsLongLong(last) : -1;
        Py_XDECREF(first);
        Py_XDECREF(last);
        if (PyErr_Occurred()) {
            return NULL;
        }
        if (len == 0 || b - a == len - 1) { /* step 1 (or a single item) */
            long long *out = positions_alloc(len);
            if (out == NULL) {
                return NULL;
            }
            for (Py_ssize_t i = 0; i < len; i++) {
                out[i] = a + i;
            }
            *n = len;
            return out;
        }
    }
    PyObject *seq = PySequence_Fast(obj, "positions must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    *n = PySequence_Fast_GET_SIZE(seq);
    long long *out = as_positions(seq);
    Py_DECREF(seq);
    return out;
}

#define MAX_TIERS 8

/* missing(path, positions, pool, tiers) -> positions with a page in `pool` on none of `tiers` */
PyObject *
radix_missing(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(4, "missing");
    Py_ssize_t npos = 0, count = 0, i = 0, ntiers = 0, pool = -1, tier[MAX_TIERS];
    PyObject *path = PySequence_Fast(args[0], "path must be a sequence");
    long long *at = path ? positions_of(args[1], &npos) : NULL;
    PyObject *tiers = at ? PySequence_Fast(args[3], "tiers must be a sequence") : NULL;
    Py_ssize_t *picked =
        NULL; /* indices into `at` of the missing ones, made into a list once counted */
    PyObject *out = NULL;
    if (tiers == NULL) {
        goto done;
    }
    ntiers = PySequence_Fast_GET_SIZE(tiers);
    if (ntiers > MAX_TIERS) {
        PyErr_Format(PyExc_ValueError, "at most %d tiers", MAX_TIERS);
        goto done;
    }
    /* Every argument an index before any node is read: no __index__ runs in the loop. */
    pool = radix_as_index(args[2]);
    for (Py_ssize_t x = 0; x < ntiers && !PyErr_Occurred(); x++) {
        tier[x] = radix_as_index(PySequence_Fast_GET_ITEM(tiers, x));
    }
    if (PyErr_Occurred()) {
        goto done;
    }
    picked = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(npos ? npos : 1)); /* npos: checked */
    if (picked == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(path); k++) {
        Node *node = radix_as_node(PySequence_Fast_GET_ITEM(path, k));
        if (node == NULL) {
            goto done;
        }
        Py_ssize_t j = bisect_left(at, node->end, i, npos);
        if (j > i) {
            PyObject *slots[MAX_TIERS]; /* borrowed: the node's page lists (or None) per tier;
                                           nothing below runs Python code that could free them */
            int all_none = 1, any_whole = 0;
            for (Py_ssize_t x = 0; x < ntiers; x++) {
                PyObject *row = radix_slot_row_at(node, tier[x], pool);
                if (row == NULL) {
                    goto done;
                }
                slots[x] = PyList_GET_ITEM(row, pool);
                all_none &= slots[x] == Py_None;
            }
            for (Py_ssize_t x = 0; x < ntiers && !all_none && !any_whole; x++) {
                int w = slots[x] == Py_None ? 0 : whole(slots[x]);
                if (w < 0) {
                    goto done;
                }
                any_whole = w;
            }
            for (Py_ssize_t y = i; y < j && !any_whole; y++) {
                int has = 0;
                for (Py_ssize_t x = 0; x < ntiers && !has && !all_none; x++) {
                    if (slots[x] == Py_None) {
                        continue;
                    }
                    PyObject *page =
                        PySequence_GetItem(slots[x], (Py_ssize_t)(at[y] - node->start));
                    int a = page ? radix_is_absent(page) : -1;
                    Py_XDECREF(page);
                    if (a < 0) {
                        goto done;
                    }
                    has = !a;
                }
                if (!has) {
                    picked[count++] = y;
                }
            }
        }
        i = j;
    }
    for (; i < npos; i++) { /* past the path: new pages */
        picked[count++] = i;
    }
    out = PyList_New(count);
    for (Py_ssize_t c = 0; out != NULL && c < count; c++) {
        PyObject *v = PyLong_FromLongLong(at[picked[c]]);
        if (v == NULL) {
            Py_CLEAR(out);
        }
        else {
            PyList_SET_ITEM(out, c, v);
        }
    }
done:
    PyMem_Free(picked);
    PyMem_Free(at);
    Py_XDECREF(path);
    Py_XDECREF(tiers);
    return out;
}

/* Places one (pool, positions, pages) placement on `nodes`, appending (node, pool, offsets)
 * to `done` per node given pages. 0, or -1 with an error set. */
static int
place_one(PyObject *nodes, PyObject *tier, PyObject *placement, PyObject *owned,
          PyObject *protected, PyObject *done)
{
    PyObject *item = PySequence_Fast(placement, "a placement is (pool, positions, pages)");
    if (item == NULL) {
        return -1;
    }
    PyObject *pos = NULL, *pages = NULL;
    long long *at = NULL;
    int err = -1;
    if (PySequence_Fast_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_ValueError, "a placement is (pool, positions, pages)");
        goto out;
    }
    PyObject *pool = PySequence_Fast_GET_ITEM(item, 0);
    pos = PySequence_Fast(PySequence_Fast_GET_ITEM(item, 1), "positions must be a sequence");
    pages = pos ? PySequence_Fast(PySequence_Fast_GET_ITEM(item, 2), "pages must be a sequence")
                : NULL;
    at = pages ? as_positions(pos) : NULL;
    if (at == NULL) {
        goto out;
    }
    Py_ssize_t npos = PySequence_Fast_GET_SIZE(pos), i = 0;
    Py_ssize_t t = radix_as_index(tier),
               p = t == -1 && PyErr_Occurred() ? -1 : radix_as_index(pool);
    if (PyErr_Occurred()) {
        goto out; /* indices first: no __index__ runs once nodes are read */
    }
    if (PySequence_Fast_GET_SIZE(pages) != npos) {
        PyErr_Format(PyExc_ValueError, "%zd positions for %zd pages", npos,
                     PySequence_Fast_GET_SIZE(pages));
        goto out;
    }
    for (Py_ssize_t y = 1; y < npos; y++) { /* a repeat would put two pages in one slot */
        if (at[y] <= at[y - 1]) {
            PyErr_Format(PyExc_ValueError, "positions must rise: %lld then %lld", at[y - 1],
                         at[y]);
            goto out;
        }
    }
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(nodes); k++) {
        Node *node = radix_as_node(PySequence_Fast_GET_ITEM(nodes, k));
        Py_ssize_t n = node ? radix_node_n(node) : -1;
        if (n < 0) {
            goto out;
        }
        Py_ssize_t j = bisect_left(at, node->end, i, npos);
        if (j == i) {
            continue;
        }
        PyObject *offsets = PyList_New(j - i), *chunk = NULL, *record = NULL;
        for (Py_ssize_t y = i; offsets && y < j; y++) {
            long long off = at[y] - node->start;
            if (off < 0 || off >= n) {
                radix_fail_assert(Py_BuildValue("(OOL)", node, pool, off));
                Py_CLEAR(offsets);
                break;
            }
            PyObject *o = PyLong_FromLongLong(off);
            if (o == NULL) {
                Py_CLEAR(offsets);
            }
            else {
                PyList_SET_ITEM(offsets, y - i, o);
            }
        }
        PyObject *row = offsets ? radix_slot_row_at(node, t, p) : NULL;
        chunk = row ? PySequence_GetSlice(pages, i, j) : NULL;
        /* recorded first: whatever fails after, the caller can undo what was given */
        record = chunk ? PyTuple_Pack(3, (PyObject *)node, pool, offsets) : NULL;
        int bad = record == NULL || PyList_Append(done, record) < 0;
        if (!bad &&
            radix_give_pages(node, row, t, p, tier, pool, offsets, chunk, owned, protected) < 0) {
            PyList_SetSlice(done, PyList_GET_SIZE(done) - 1, PyList_GET_SIZE(done), NULL);
            bad = 1;
        }
        Py_XDECREF(offsets);
        Py_XDECREF(chunk);
        Py_XDECREF(record);
        if (bad) {
            goto out;
        }
        i = j;
    }
    if (i < npos) {
        radix_fail_assert(
            Py_BuildValue("(sO)", "positions past the nodes", PySequence_Fast_GET_ITEM(pos, i)));
        goto out;
    }
    err = 0;
out:
    PyMem_Free(at);
    Py_XDECREF(pos);
    Py_XDECREF(pages);
    Py_DECREF(item);
    return err;
}

/* place_runs(nodes, tier, placements, owned, protected) -> [(node, pool, offsets), ...]: each
 * (pool, positions, pages) of `placements` given to the nodes holding its positions; all or
 * nothing. */
PyObject *
radix_place_runs(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ARGS(5, "place_runs");
    PyObject *nodes = PySequence_Fast(args[0], "nodes must be a sequence");
    PyObject *placements =
        nodes ? PySequence_Fast(args[2], "placements must be a sequence") : NULL;
    PyObject *done = placements ? PyList_New(0) : NULL;
    int err = done == NULL;
    for (Py_ssize_t k = 0; !err && k < PySequence_Fast_GET_SIZE(placements); k++) {
        err = place_one(nodes, args[1], PySequence_Fast_GET_ITEM(placements, k), args[3], args[4],
                        done) < 0;
    }
    if (err && done != NULL) { /* undo, newest first, keeping the first error */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        for (Py_ssize_t k = PyList_GET_SIZE(done) - 1; k >= 0; k--) {
            PyObject *rec = PyList_GET_ITEM(done, k);
            Node *node = (Node *)PyTuple_GET_ITEM(rec, 0);
            Py_ssize_t t, p;
            PyObject *row = radix_slot_row(node, args[1], PyTuple_GET_ITEM(rec, 1), &t, &p);
            PyObject *undone =
                row ? radix_take_pages(node, row, t, p, args[1], PyTuple_GET_ITEM(rec, 1),
                                       PyTuple_GET_ITEM(rec, 2), args[3], args[4])
                    : NULL;
            if (undone == NULL) {
                PyErr_Clear();
            }
            Py_XDECREF(undone);
        }
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(nodes);
    Py_XDECREF(placements);
    if (err) {
        Py_CLEAR(done);
    }
    return done;
}
