/* kvfabric.core.cache._alloc: the native PageAllocator of core/cache/allocator.py.
 *
 * Free pages are an int32 stack (its top is handed out next) and used ones a bitmap, so
 * alloc, free and take touch no Python objects but the ints passed in and out. The page
 * order, errors and messages are the reference's; every input is checked before anything
 * changes. It holds no Python objects, so the garbage collector does not track it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>

#define MAX_PAGES INT32_MAX /* page indices are int32 */

/* allocator.py's AllocatorError and OutOfPages once set_errors has run (RuntimeError before). */
static PyObject *allocator_error, *out_of_pages;

typedef struct {
    PyObject_HEAD Py_ssize_t capacity, nfree;
    int32_t *stack; /* the free pages; stack[nfree - 1] is handed out next */
    uint64_t *used; /* bit i set: page i is in use */
} Allocator;

static int
is_used(const Allocator *a, Py_ssize_t i)
{
    return (int)((a->used[i >> 6] >> (i & 63)) & 1);
}

static void
flip(Allocator *a, Py_ssize_t i)
{
    a->used[i >> 6] ^= 1ULL << (i & 63);
}

static PyObject *
allocator_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", NULL};
    PyObject *arg;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:PageAllocator", names, &arg)) {
        return NULL;
    }
    int overflow = 0;
    long long capacity = PyLong_Check(arg) && !PyBool_Check(arg)
                             ? PyLong_AsLongLongAndOverflow(arg, &overflow)
                             : -1;
    if (capacity == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow || capacity < 0 || capacity > MAX_PAGES) {
        return PyErr_Format(PyExc_ValueError, "capacity must be an int in [0, %d], got %R",
                            MAX_PAGES, arg);
    }
    Allocator *a = (Allocator *)type->tp_alloc(type, 0);
    if (a == NULL) {
        return NULL;
    }
    a->stack = PyMem_Malloc(sizeof(int32_t) * (size_t)capacity);
    a->used = PyMem_Calloc((size_t)(capacity + 63) / 64, sizeof(uint64_t));
    if (a->stack == NULL || a->used == NULL) {
        Py_DECREF(a);
        return PyErr_NoMemory();
    }
    a->capacity = a->nfree = (Py_ssize_t)capacity;
    for (Py_ssize_t k = 0; k < a->capacity; k++) { /* ascending from the top: 0 goes first */
        a->stack[k] = (int32_t)(a->capacity - 1 - k);
    }
    return (PyObject *)a;
}

static void
allocator_dealloc(Allocator *a)
{
    PyMem_Free(a->stack);
    PyMem_Free(a->used);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

/* alloc(n) -> the n pages on top of the free stack, top first; [] for n <= 0. */
static PyObject *
allocator_alloc(Allocator *a, PyObject *arg)
{
    if (!PyLong_Check(arg) || PyBool_Check(arg)) {
        return PyErr_Format(PyExc_TypeError, "n must be an int, got %R", arg);
    }
    int overflow;
    long long n = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow > 0 || n > a->nfree) {
        return PyErr_Format(out_of_pages, "want %S pages, %zd free of %zd", arg, a->nfree,
                            a->capacity);
    }
    if (overflow < 0 || n <= 0) {
        return PyList_New(0);
    }
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL) {
        return NULL;
    }
    int32_t *top = a->stack + a->nfree - 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *page = PyLong_FromLong(top[-j]);
        if (page == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, page);
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        flip(a, top[-j]);
    }
    a->nfree -= (Py_ssize_t)n;
    return out;
}

/* Each item of `indices` (a list or tuple: *items, *n) checked and flipped from used
 * (want_used) or free to the other state, so a repeat finds its page already flipped. On
 * the first bad page the flips are undone and -1 returned with an AllocatorError naming it. */
static int
flip_all(Allocator *a, PyObject *indices, int want_used, PyObject ***out, Py_ssize_t *n)
{
    if (!PyList_Check(indices) && !PyTuple_Check(indices)) {
        PyErr_Format(PyExc_TypeError, "indices must be a list or tuple of ints, got %.200s",
                     Py_TYPE(indices)->tp_name);
        return -1;
    }
    PyObject **items = *out = PySequence_Fast_ITEMS(indices); /* NULL for an empty list */
    *n = PySequence_Fast_GET_SIZE(indices);
    for (Py_ssize_t j = 0; j < *n; j++) {
        int overflow = 0;
        long long i =
            PyLong_CheckExact(items[j]) ? PyLong_AsLongLongAndOverflow(items[j], &overflow) : -1;
        int outside = overflow || i < 0 || i >= a->capacity;
        if (!outside && is_used(a, (Py_ssize_t)i) == want_used) {
            flip(a, (Py_ssize_t)i);
            continue;
        }
        /* Undone before the message is made: a repr may run code that changes `indices`. */
        PyObject *bad = Py_NewRef(items[j]);
        for (Py_ssize_t k = 0; k < j; k++) {
            flip(a, PyLong_AsSsize_t(items[k])); /* checked */
        }
        if (outside) {
            PyErr_Format(allocator_error, "page %R is not in this allocator (capacity %zd)", bad,
                         a->capacity);
        }
        else {
            PyErr_Format(allocator_error, "page %R is already %s", bad,
                         want_used ? "free" : "in use");
        }
        Py_DECREF(bad);
        return -1;
    }
    return 0;
}

/* free(indices): pages in use become free; the next alloc hands them out in this order. */
static PyObject *
allocator_free(Allocator *a, PyObject *indices)
{
    PyObject **items;
    Py_ssize_t n;
    if (flip_all(a, indices, 1, &items, &n) < 0) {
        return NULL;
    }
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        a->stack[a->nfree++] = (int32_t)PyLong_AsLong(items[j]);
    }
    Py_RETURN_NONE;
}

/* take(indices): free pages become used (the undo of a free); O(capacity), so rare. */
static PyObject *
allocator_take(Allocator *a, PyObject *indices)
{
    PyObject **items;
    Py_ssize_t n, kept = 0;
    if (flip_all(a, indices, 0, &items, &n) < 0) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < a->nfree; k++) { /* the rest keep their order */
        if (!is_used(a, a->stack[k])) {
            a->stack[kept++] = a->stack[k];
        }
    }
    a->nfree = kept;
    Py_RETURN_NONE;
}

/* used_indices() -> a new set of the pages in use. */
static PyObject *
allocator_used_indices(Allocator *a, PyObject *Py_UNUSED(unused))
{
    PyObject *out = PySet_New(NULL);
    for (Py_ssize_t w = 0; out != NULL && w < (a->capacity + 63) / 64; w++) {
        for (uint64_t bits = a->used[w]; bits; bits &= bits - 1) {
            PyObject *page = PyLong_FromSsize_t(w * 64 + __builtin_ctzll(bits));
            if (page == NULL || PySet_Add(out, page) < 0) {
                Py_XDECREF(page);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(page);
        }
    }
    return out;
}

static PyObject *
get_free_count(Allocator *a, void *Py_UNUSED(unused))
{
    return PyLong_FromSsize_t(a->nfree);
}

static PyObject *
get_used_count(Allocator *a, void *Py_UNUSED(unused))
{
    return PyLong_FromSsize_t(a->capacity - a->nfree);
}

static PyGetSetDef allocator_getset[] = {
    {"free_count", (getter)get_free_count, NULL, NULL, NULL},
    {"used_count", (getter)get_used_count, NULL, NULL, NULL},
    {NULL},
};

static PyMemberDef allocator_members[] = {
    {"capacity", T_PYSSIZET, offsetof(Allocator, capacity), READONLY, NULL},
    {NULL},
};

static PyMethodDef allocator_methods[] = {
    {"alloc", (PyCFunction)allocator_alloc, METH_O, "alloc(n) -> n pages"},
    {"free", (PyCFunction)allocator_free, METH_O, "free(indices)"},
    {"take", (PyCFunction)allocator_take, METH_O, "take(indices)"},
    {"used_indices", (PyCFunction)allocator_used_indices, METH_NOARGS, "-> set of pages in use"},
    {NULL},
};

static PyTypeObject AllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric.core.cache._alloc.PageAllocator",
    .tp_doc = "Hands out page indices in [0, capacity) (see core/cache/allocator.py).",
    .tp_basicsize = sizeof(Allocator),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = allocator_new,
    .tp_dealloc = (destructor)allocator_dealloc,
    .tp_getset = allocator_getset,
    .tp_members = allocator_members,
    .tp_methods = allocator_methods,
};

static PyObject *
set_errors(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "set_errors takes 2 arguments");
    }
    for (Py_ssize_t k = 0; k < nargs; k++) {
        if (!PyType_Check(args[k]) ||
            !PyType_IsSubtype((PyTypeObject *)args[k], (PyTypeObject *)PyExc_Exception)) {
            return PyErr_Format(PyExc_TypeError, "set_errors takes Exception subclasses, got %R",
                                args[k]);
        }
    }
    Py_SETREF(allocator_error, Py_NewRef(args[0]));
    Py_SETREF(out_of_pages, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"set_errors", (PyCFunction)(void (*)(void))set_errors, METH_FASTCALL,
     "set_errors(AllocatorError, OutOfPages): the error types misuse raises"},
    {NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_alloc",
    .m_doc = "The page allocator in C.",
    .m_size = -1,
    .m_methods = functions,
};

PyMODINIT_FUNC
PyInit__alloc(void)
{
    if (PyType_Ready(&AllocatorType) < 0) {
        return NULL;
    }
    allocator_error = Py_NewRef(PyExc_RuntimeError), out_of_pages = Py_NewRef(PyExc_RuntimeError);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "PageAllocator", (PyObject *)&AllocatorType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PAGES", MAX_PAGES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
