/* kvfabric.core.cache._copy: rows of one strided array copied into rows of another in
 * one pass over the bytes (core/cache/pages.py's copy_rows does the same with one
 * torch copy_ per run of consecutive rows: the reference). Pages scattered over vLLM's
 * blocks make runs of one row, and a copy_ call costs about 5 us against 3 us for a
 * 32 KiB page's bytes.
 *
 * copy_rows(src, src_rows, dst, dst_rows) sets dst[dst_rows[i]] = src[src_rows[i]]
 * for every i. src and dst are buffers of any strides (numpy views of tensors: a
 * permuted view reorders as it copies), of one item size and the same shape after the
 * first dimension; the rows are 1-d int64 buffers of one length, every index in range
 * (checked before a byte moves). The innermost dimensions contiguous in both are
 * copied as one memcpy. The GIL is released while copying; nothing is kept across
 * calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define COPY_WIDE 1 /* 32- and 64-byte streamed stores, where the CPU has them */
#endif

#define COPY_MAX_DIMS 16
/* Past this many bytes a copy streams its stores past the caches (as glibc's memcpy does
 * for large copies): the bytes go to memory anyway, and a cached store reads each line
 * first. Measured 2-2.8x a memcpy with cached stores, against 1.0-1.3x streamed. */
#define COPY_STREAM_BYTES (4 << 20)

static int
get_rows(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    if (view->ndim != 1 || view->itemsize != 8 || strchr("qlQL", *f) == NULL || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-d buffer of 8-byte ints", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
get_array(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (view->ndim < 1 || view->ndim > COPY_MAX_DIMS || view->strides == NULL) {
        PyErr_Format(PyExc_ValueError, "%s must have 1 to %d dimensions", what, COPY_MAX_DIMS);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
rows_in_range(const int64_t *rows, Py_ssize_t n, Py_ssize_t limit)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= limit) {
            return 0;
        }
    }
    return 1;
}

/* The shape of one row as (dims, shape, src and dst strides), the innermost dimensions
 * contiguous in both folded into one memcpy of *run bytes. */
typedef struct {
    int dims;
    Py_ssize_t shape[COPY_MAX_DIMS];
    Py_ssize_t src_strides[COPY_MAX_DIMS];
    Py_ssize_t dst_strides[COPY_MAX_DIMS];
    Py_ssize_t run;
} RowShape;

static Py_ssize_t
span(Py_ssize_t stride)
{
    return stride < 0 ? -stride : stride;
}

/* The dimensions are walked in the source's memory order (widest source stride
 * outermost): reads run on and the streamed stores may scatter, as each fills whole
 * lines. Walked in the destination's order instead, a permuted copy's reads jump and
 * took 1.5-2x as long (2x in a C loop of 256-byte runs, docs/internals.md). */
static void
row_shape(const Py_buffer *src, const Py_buffer *dst, RowShape *out)
{
    int last = src->ndim - 1;
    Py_ssize_t run = src->itemsize;
    while (last >= 1 && src->strides[last] == run && dst->strides[last] == run) {
        run *= src->shape[last];
        last--;
    }
    out->run = run;
    out->dims = 0;
    for (int d = 1; d <= last; d++) {
        int at = out->dims++;
        while (at > 0 && span(out->src_strides[at - 1]) < span(src->strides[d])) {
            out->shape[at] = out->shape[at - 1];
            out->src_strides[at] = out->src_strides[at - 1];
            out->dst_strides[at] = out->dst_strides[at - 1];
            at--;
        }
        out->shape[at] = src->shape[d];
        out->src_strides[at] = src->strides[d];
        out->dst_strides[at] = dst->strides[d];
    }
}

/* How a run's bytes are stored: through the caches, or streamed past them 16, 32 or 64
 * bytes at a time (the widest the CPU has: 64-byte stores took 0.75x a memcpy's time and
 * 16-byte ones 1.05x for 256-byte runs on this project's AMD host). */
typedef enum {
    COPY_CACHED,
    COPY_STREAM_16,
    COPY_STREAM_32,
    COPY_STREAM_64,
} CopyStores;

static CopyStores copy_widest = COPY_STREAM_16; /* set once, at import */

#if defined(COPY_WIDE)
__attribute__((target("avx2"))) static void
stream_32(char *dst, const char *src, Py_ssize_t run)
{
    for (Py_ssize_t i = 0; i < run; i += 32) {
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
    }
}

__attribute__((target("avx512f"))) static void
stream_64(char *dst, const char *src, Py_ssize_t run)
{
    for (Py_ssize_t i = 0; i < run; i += 64) {
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
    }
}
#endif

/* One run of bytes: streamed where `dst` and the run are aligned to the stores' width. */
static void
copy_run(char *dst, const char *src, Py_ssize_t run, CopyStores stores)
{
    uintptr_t where = (uintptr_t)dst | (uintptr_t)run;
#if defined(COPY_WIDE)
    if (stores == COPY_STREAM_64 && (where & 63) == 0) {
        stream_64(dst, src, run);
        return;
    }
    if (stores >= COPY_STREAM_32 && (where & 31) == 0) {
        stream_32(dst, src, run);
        return;
    }
#endif
#if defined(__SSE2__)
    if (stores != COPY_CACHED && (where & 15) == 0) {
        for (Py_ssize_t i = 0; i < run; i += 16) {
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        }
        return;
    }
#endif
    (void)where;
    memmove(dst, src, (size_t)run); /* a pool copying within itself */
}

static void
copy_row(const RowShape *s, const char *src, char *dst, CopyStores stores)
{
    if (s->dims == 0) {
        copy_run(dst, src, s->run, stores);
        return;
    }
    /* The innermost walked dimension as a plain loop: an odometer step per run cost a
     * tenth of a 256-byte run's copy. */
    int inner = s->dims - 1;
    Py_ssize_t count = s->shape[inner], src_step = s->src_strides[inner],
               dst_step = s->dst_strides[inner];
    Py_ssize_t index[COPY_MAX_DIMS] = {0};
    for (;;) {
        for (Py_ssize_t k = 0; k < count; k++) {
            copy_run(dst + k * dst_step, src + k * src_step, s->run, stores);
        }
        int d = inner - 1;
        for (; d >= 0; d--) {
            src += s->src_strides[d];
            dst += s->dst_strides[d];
            if (++index[d] < s->shape[d]) {
                break;
            }
            src -= s->src_strides[d] * s->shape[d];
            dst -= s->dst_strides[d] * s->shape[d];
            index[d] = 0;
        }
        if (d < 0) {
            return;
        }
    }
}

static int
same_row_shape(const Py_buffer *src, const Py_buffer *dst)
{
    if (src->ndim != dst->ndim || src->itemsize != dst->itemsize) {
        return 0;
    }
    for (int d = 1; d < src->ndim; d++) {
        if (src->shape[d] != dst->shape[d]) {
            return 0;
        }
    }
    return 1;
}

/* One copy's buffers, checked, with what running it needs. */
typedef struct {
    Py_buffer views[4]; /* src, src_rows, dst, dst_rows */
    int got;            /* how many views are held */
    Py_ssize_t n;       /* rows */
    Py_ssize_t bytes;   /* n rows' bytes; 0: nothing to copy */
    RowShape shape;
} Prepared;

static void
release(Prepared *p)
{
    while (p->got > 0) {
        PyBuffer_Release(&p->views[--p->got]);
    }
}

/* args: src, src_rows, dst, dst_rows. Every check before a byte moves; on failure the
 * error is set and nothing is held. */
static int
prepare(PyObject *const *args, Prepared *p)
{
    static const char *const names[4] = {"src", "src_rows", "dst", "dst_rows"};
    for (p->got = 0; p->got < 4; p->got++) {
        int i = p->got; /* odd: rows; 2: the one written */
        int ok = i % 2 ? get_rows(args[i], &p->views[i], names[i])
                       : get_array(args[i], &p->views[i], i == 2, names[i]);
        if (ok < 0) {
            goto fail;
        }
    }
    const Py_buffer *src = &p->views[0], *dst = &p->views[2];
    p->n = p->views[1].shape[0];
    if (p->views[3].shape[0] != p->n) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: src_rows and dst_rows differ in length");
        goto fail;
    }
    if (!same_row_shape(src, dst)) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_rows: src and dst differ in item size or in a row's shape");
        goto fail;
    }
    if (!rows_in_range(p->views[1].buf, p->n, src->shape[0]) ||
        !rows_in_range(p->views[3].buf, p->n, dst->shape[0])) {
        PyErr_SetString(PyExc_IndexError, "copy_rows: a row index is out of range");
        goto fail;
    }
    Py_ssize_t row_bytes = src->itemsize;
    for (int d = 1; d < src->ndim; d++) {
        row_bytes *= src->shape[d];
    }
    p->bytes = p->n * row_bytes; /* 0 for rows of no bytes: nothing to copy */
    row_shape(src, dst, &p->shape);
    return 0;
fail:
    release(p);
    return -1;
}

/* Without the GIL. */
static void
run(const Prepared *p, CopyStores stores)
{
    if (p->bytes == 0) {
        return;
    }
    const Py_buffer *src = &p->views[0], *dst = &p->views[2];
    const int64_t *src_rows = p->views[1].buf, *dst_rows = p->views[3].buf;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        copy_row(&p->shape, (const char *)src->buf + src_rows[i] * src->strides[0],
                 (char *)dst->buf + dst_rows[i] * dst->strides[0], stores);
    }
}

/* Runs `count` prepared copies with the GIL released once, streamed past the caches
 * where they move COPY_STREAM_BYTES or more in all. */
static void
run_all(const Prepared *ps, Py_ssize_t count)
{
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        total += ps[i].bytes;
    }
    CopyStores stores = total >= COPY_STREAM_BYTES ? copy_widest : COPY_CACHED;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < count; i++) {
        run(&ps[i], stores);
    }
#if defined(__SSE2__)
    if (stores != COPY_CACHED) {
        _mm_sfence(); /* the streamed stores are visible before we return */
    }
#endif
    Py_END_ALLOW_THREADS;
}

static PyObject *
copy_copy_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        return PyErr_Format(PyExc_TypeError, "copy_rows takes 4 arguments, got %zd", nargs);
    }
    Prepared p;
    if (prepare(args, &p) < 0) {
        return NULL;
    }
    run_all(&p, 1);
    release(&p);
    Py_RETURN_NONE;
}

/* copy_many(copies): copy_rows(*c) for every 4-item tuple c of the sequence, every one
 * checked before a byte moves and the GIL released once for them all (a copy thread
 * beside the engine's forward takes the GIL back once, not once a layer). */
static PyObject *
copy_copy_many(PyObject *Py_UNUSED(module), PyObject *copies)
{
    PyObject *seq = PySequence_Fast(copies, "copy_many takes a sequence of copies");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), ready = 0;
    Prepared *ps = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Prepared));
    PyObject *result = NULL;
    if (ps == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; ready < count; ready++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, ready);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_Format(PyExc_TypeError,
                         "copy_many: copy %zd is not a (src, src_rows, dst, dst_rows) tuple",
                         ready);
            goto done;
        }
        /* The tuple holds its items, and the sequence the tuple, while they are read. */
        if (prepare(&PyTuple_GET_ITEM(item, 0), &ps[ready]) < 0) {
            goto done;
        }
    }
    run_all(ps, count);
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < ready; i++) {
        release(&ps[i]);
    }
    PyMem_Free(ps);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef copy_functions[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_copy_rows, METH_FASTCALL,
     "copy_rows(src, src_rows, dst, dst_rows): dst[dst_rows[i]] = src[src_rows[i]]"},
    {"copy_many", copy_copy_many, METH_O,
     "copy_many(copies): copy_rows(*c) for each (src, src_rows, dst, dst_rows) tuple c, "
     "all checked first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef copy_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_copy",
    .m_doc = "Rows of strided arrays copied in C.",
    .m_size = -1,
    .m_methods = copy_functions,
};

PyMODINIT_FUNC
PyInit__copy(void)
{
#if defined(COPY_WIDE)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        copy_widest = COPY_STREAM_64;
    }
    else if (__builtin_cpu_supports("avx2")) {
        copy_widest = COPY_STREAM_32;
    }
#endif
    return PyModule_Create(&copy_module);
}
