/* The radix tree's node as a C type (nodes.c) and the tree's hot primitives over it
 * (nodes_tree.c): the native side of core/cache/nodes.py, which stays the reference. */
#ifndef KVF_NODES_H
#define KVF_NODES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The attributes the pure-Python TreeNode has, with the same Python types: the
 * containers stay Python lists and dicts so every caller reads them unchanged. */
typedef struct {
    PyObject_HEAD PyObject *keys; /* list[bytes]: chained key per page (a root: [namespace key]) */
    PyObject *tokens;             /* bytes: token bytes of the run */
    PyObject *parent;             /* TreeNode or None */
    PyObject *children;           /* dict[bytes, TreeNode]: keyed by a child's first page bytes */
    PyObject *slots;              /* [tier][pool] -> list[int] | None */
    PyObject *locks;              /* [pool] -> int */
    long long start, end, last_access, hits;
} Node;

extern PyTypeObject radix_NodeType;
extern PyMethodDef radix_node_functions[]; /* live_nodes(): the module adds them beside TreeNode */

#define IS_NODE(o)  (Py_TYPE(o) == &radix_NodeType)
#define RADIX_TIERS 3 /* device, host, disk: layout.Tier */

/* RadixTree's own fields (radix.c): the native RadixTree derives from this type, so
 * radix_insert.c keeps its counters, containers and logs in place. A NULL object field reads as
 * None. The pure-Python RadixTree has the same attributes in its __dict__. */
typedef struct {
    PyObject_HEAD Py_ssize_t page_bytes;
    long long clock, node_count, page_count, version;
    PyObject *roots;             /* dict[bytes, TreeNode]: namespace root key -> root */
    PyObject *by_first_key;      /* dict[bytes, TreeNode]: a node's first page's key -> node */
    PyObject *owned, *protected; /* [tier][pool] page counters */
    PyObject *changes;           /* ChangeLog or None */
    PyObject *dirty;             /* set[TreeNode] or None */
} TreeState;

extern PyTypeObject radix_TreeStateType;

/* A new node as TreeNode(keys, tokens, parent, start) makes it (keys is kept, not copied). */
Node *radix_node_new(PyObject *keys, PyObject *tokens, PyObject *parent, long long start);
/* The run's page count (0 for a namespace root); -1 with an error set. */
Py_ssize_t radix_node_n(Node *node);
/* slots[tier] as a list (borrowed), with a TypeError or IndexError when it is not one. */
PyObject *radix_node_tier(Node *node, Py_ssize_t tier);
/* 1 where the object is the ABSENT marker (-1), 0 where not, -1 on error. */
int radix_is_absent(PyObject *page);

extern PyObject *radix_absent_page, *radix_zero; /* the ints -1 and 0 */

/* Takes a list whose items are all outside the collector (ints, bytes, None, nodes, or
 * lists taken out already) out of the collector's tracked set: it cannot be part of a
 * reference cycle. Lists, unlike dicts, stay tracked until told; with the node type
 * outside the collector too, a collection then walks nothing of the tree. Returns `list`. */
PyObject *radix_untrack_leaf(PyObject *list);

/* Shared by nodes_tree.c and nodes_slots.c. */
#define ARGS(N, SIG)                                                                              \
    do {                                                                                          \
        if (nargs != N) {                                                                         \
            return PyErr_Format(PyExc_TypeError, SIG " takes %d arguments", N);                   \
        }                                                                                         \
    } while (0)
Node *radix_as_node(PyObject *o);       /* a live native node, or NULL with an error */
Py_ssize_t radix_as_index(PyObject *o); /* a tier or pool as an index */
void radix_fail_assert(PyObject *why);  /* AssertionError(why); steals `why` */
int radix_add(PyObject *grid, Py_ssize_t t, Py_ssize_t p, Py_ssize_t delta); /* grid[t][p] += */
Py_ssize_t radix_held(PyObject *pages); /* pages not ABSENT, -1 on error */
int radix_count(Node *node, Py_ssize_t t, Py_ssize_t p, Py_ssize_t delta, PyObject *owned,
                PyObject *protected); /* RadixTree._count */
Py_ssize_t radix_lock_of(Node *node,
                         Py_ssize_t p); /* node.locks[p]: an int >= 0, or -1 with an error */
/* nodes_slots.c's per-node page moves, shared with radix_insert.c. */
PyObject *radix_slot_row(Node *node, PyObject *tier, PyObject *pool, Py_ssize_t *t, Py_ssize_t *p);
PyObject *radix_slot_row_at(Node *node, Py_ssize_t t, Py_ssize_t p);
int radix_all_ints(PyObject *seq, const char *what);
int radix_give_pages(Node *node, PyObject *row, Py_ssize_t t, Py_ssize_t p, PyObject *tier,
                     PyObject *pool, PyObject *offsets, PyObject *pages, PyObject *owned,
                     PyObject *protected);
PyObject *radix_take_pages(Node *node, PyObject *row, Py_ssize_t t, Py_ssize_t p, PyObject *tier,
                           PyObject *pool, PyObject *offsets, PyObject *owned,
                           PyObject *protected);
PyObject *radix_missing(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_place_runs(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_walk(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_walk_from(PyObject *roots, PyObject *root_key, PyObject *raw, Py_ssize_t step);
PyObject *radix_walk_keys(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_touch(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_attach(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_split(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *radix_grow(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
/* attach()'s work: the new child of `parent`, in its children and in by_first_key. */
Node *radix_attach_node(Node *parent, PyObject *keys, PyObject *tokens, Py_ssize_t step,
                        PyObject *by_first_key, long long clock);
/* grow() with its step and clock as C values (nodes_tree.c): (nodes, given), or NULL with an
 * error and the tree as it was. */
PyObject *radix_grow_at(PyObject *path, PyObject *parent, PyObject *keys, PyObject *tokens,
                        Py_ssize_t step, PyObject *tier, PyObject *placements,
                        PyObject *by_first_key, PyObject *owned, PyObject *protected,
                        long long clock);
PyObject *radix_insert_free(TreeState *tree, PyObject *const *args, Py_ssize_t nargs);

#endif
