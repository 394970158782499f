/* kvfabric.transport._plan: a page read's plan in one call (transport/base.py's
 * plan_pool_read does the same in numpy: the reference, ~20 us at 64 pages, which is 5%
 * of a 4 MiB read over CMA).
 *
 * order(remote, local, remote_capacity, local_capacity, out_remote, out_local) checks
 * that every index is in range and no local page is named twice, writes the pairs
 * sorted by remote page (stably: ties keep their order) into the int32 outputs, and
 * returns how many runs contiguous on both sides they form (= descriptors once merged);
 * -1 if an index is out of range or a local page repeats (the reference then says which).
 * Inputs are 1-d contiguous int64 buffers, outputs writable int32 ones of the same
 * length. It keeps no Python objects across calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MASK_PER_INDEX 64 /* as base.py: a bitmap while it is cheaper than a sort */

typedef struct {
    int64_t remote, local;
} Pair;

static int
get_view(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    int integer = strchr(itemsize == 8 ? "qlQL" : "iI", *f) != NULL && f[1] == '\0';
    if (view->ndim != 1 || view->itemsize != itemsize || !integer) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-d buffer of %zd-byte ints", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
in_range(const int64_t *idx, Py_ssize_t n, int64_t capacity)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= capacity) {
            return 0;
        }
    }
    return 1;
}

/* Stable bottom-up merge sort of pairs by remote page; `tmp` holds n pairs. */
static void
sort_pairs(Pair *a, Pair *tmp, Py_ssize_t n)
{
    Pair *src = a, *dst = tmp;
    for (Py_ssize_t width = 1; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n;
            Py_ssize_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) { /* ties take the left: stable */
                dst[k++] = src[j].remote < src[i].remote ? src[j++] : src[i++];
            }
            while (i < mid) {
                dst[k++] = src[i++];
            }
            while (j < hi) {
                dst[k++] = src[j++];
            }
        }
        Pair *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) {
        memcpy(a, src, sizeof(Pair) * (size_t)n);
    }
}

static int
cmp_int64(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* 1 if a local page repeats, 0 if not, -1 on a memory error (set). */
static int
has_duplicates(const int64_t *idx, Py_ssize_t n, int64_t capacity)
{
    if (capacity <= MASK_PER_INDEX * (n > 64 ? n : 64)) {
        uint64_t *seen = PyMem_Calloc((size_t)(capacity + 63) / 64, sizeof(uint64_t));
        if (seen == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        int dup = 0;
        for (Py_ssize_t i = 0; i < n && !dup; i++) {
            uint64_t bit = 1ULL << (idx[i] & 63);
            dup = (seen[idx[i] >> 6] & bit) != 0;
            seen[idx[i] >> 6] |= bit;
        }
        PyMem_Free(seen);
        return dup;
    }
    int64_t *sorted = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(sorted, idx, sizeof(int64_t) * (size_t)n);
    qsort(sorted, (size_t)n, sizeof(int64_t), cmp_int64);
    int dup = 0;
    for (Py_ssize_t i = 1; i < n && !dup; i++) {
        dup = sorted[i] == sorted[i - 1];
    }
    PyMem_Free(sorted);
    return dup;
}

/* The plan of checked pairs into the outputs; its run count, or -1 (error set). */
static Py_ssize_t
order_into(const int64_t *remote, const int64_t *local, Py_ssize_t n, int32_t *out_remote,
           int32_t *out_local)
{
    Pair *pairs = PyMem_Malloc(sizeof(Pair) * (size_t)(2 * n + 1));
    if (pairs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        pairs[i].remote = remote[i];
        pairs[i].local = local[i];
        sorted &= i == 0 || remote[i - 1] <= remote[i];
    }
    if (!sorted) {
        sort_pairs(pairs, pairs + n, n);
    }
    Py_ssize_t runs = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        out_remote[i] = (int32_t)pairs[i].remote;
        out_local[i] = (int32_t)pairs[i].local;
        runs += i == 0 || pairs[i].remote != pairs[i - 1].remote + 1 ||
                pairs[i].local != pairs[i - 1].local + 1;
    }
    PyMem_Free(pairs);
    return runs;
}

static PyObject *
plan_order(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        return PyErr_Format(PyExc_TypeError, "order takes 6 arguments, got %zd", nargs);
    }
    int64_t caps[2];
    for (int k = 0; k < 2; k++) {
        caps[k] = PyLong_Check(args[2 + k]) ? PyLong_AsLongLong(args[2 + k]) : -1;
        if (caps[k] == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (caps[k] < 1 || caps[k] > (int64_t)INT32_MAX + 1) {
            return PyErr_Format(PyExc_ValueError, "capacities must be ints in [1, 2**31], got %R",
                                args[2 + k]);
        }
    }
    Py_buffer views[4];
    static const char *what[4] = {"remote", "local", "out_remote", "out_local"};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++) {
        if (get_view(args[got < 2 ? got : got + 2], &views[got], got >= 2, got < 2 ? 8 : 4,
                     what[got]) < 0) {
            goto done;
        }
    }
    Py_ssize_t n = views[0].shape[0];
    if (views[1].shape[0] != n || views[2].shape[0] != n || views[3].shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "order: all four buffers must be of one length");
        goto done;
    }
    const int64_t *remote = views[0].buf, *local = views[1].buf;
    if (!in_range(remote, n, caps[0]) || !in_range(local, n, caps[1])) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    int dup = has_duplicates(local, n, caps[1]);
    if (dup != 0) {
        if (dup > 0) {
            result = PyLong_FromLong(-1);
        }
        goto done;
    }
    Py_ssize_t runs = order_into(remote, local, n, views[2].buf, views[3].buf);
    if (runs >= 0) {
        result = PyLong_FromSsize_t(runs);
    }
done:
    while (got-- > 0) {
        PyBuffer_Release(&views[got]);
    }
    return result;
}

static PyMethodDef functions[] = {
    {"order", (PyCFunction)(void (*)(void))plan_order, METH_FASTCALL,
     "order(remote, local, remote_capacity, local_capacity, out_remote, out_local) -> runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_plan",
    .m_doc = "A page read's plan in C.",
    .m_size = -1,
    .m_methods = functions,
};

PyMODINIT_FUNC
PyInit__plan(void)
{
    return PyModule_Create(&module);
}
