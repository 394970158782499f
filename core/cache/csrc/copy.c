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
 * calls. CopyQueue runs such copies later, on a thread of its own (below). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
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

/* The bytes that `rows` (n >= 1) of buffer `b` span, as [span[0], span[1]) addresses. */
static void
rows_extent(const Py_buffer *b, const int64_t *rows, Py_ssize_t n, intptr_t span[2])
{
    Py_ssize_t below = 0, above = b->itemsize; /* a row's reach from its first item */
    for (int d = 1; d < b->ndim; d++) {
        Py_ssize_t reach = b->strides[d] * (b->shape[d] - 1);
        if (reach < 0) {
            below += reach;
        }
        else {
            above += reach;
        }
    }
    int64_t first = rows[0], last = rows[0];
    for (Py_ssize_t i = 1; i < n; i++) {
        first = rows[i] < first ? rows[i] : first;
        last = rows[i] > last ? rows[i] : last;
    }
    Py_ssize_t a = (Py_ssize_t)first * b->strides[0], z = (Py_ssize_t)last * b->strides[0];
    span[0] = (intptr_t)b->buf + (a < z ? a : z) + below;
    span[1] = (intptr_t)b->buf + (a < z ? z : a) + above;
}

static int
overlap(const intptr_t a[2], const intptr_t b[2])
{
    return a[0] < b[1] && b[0] < a[1];
}

/* One copy's buffers, checked, with what running it needs. */
typedef struct {
    Py_buffer views[4]; /* src, src_rows, dst, dst_rows */
    int got;            /* how many views are held */
    Py_ssize_t n;       /* rows */
    Py_ssize_t bytes;   /* n rows' bytes; 0: nothing to copy */
    RowShape shape;
    intptr_t reads[2], writes[2]; /* the bytes the rows span, [lo, hi), where bytes > 0 */
    Py_ssize_t lead; /* the first copy of its group (see group_rows); itself if none */
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
    if (p->bytes > 0) {
        rows_extent(src, p->views[1].buf, p->n, p->reads);
        rows_extent(dst, p->views[3].buf, p->n, p->writes);
    }
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

/* How `count` prepared copies store their bytes: streamed past the caches where they move
 * COPY_STREAM_BYTES or more in all. */
static CopyStores
stores_for(const Prepared *ps, Py_ssize_t count)
{
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        total += ps[i].bytes;
    }
    return total >= COPY_STREAM_BYTES ? copy_widest : COPY_CACHED;
}

/* Whether copies a and b read parts of the same source rows (slices of one array, as a
 * load reads each layer's part of every staged page of a pool), in the same order. */
static int
same_rows(const Prepared *a, const Prepared *b)
{
    const Py_buffer *x = &a->views[0], *y = &b->views[0];
    Py_ssize_t stride = x->strides[0], apart = (const char *)y->buf - (const char *)x->buf;
    return a->bytes > 0 && b->bytes > 0 && a->n == b->n && y->strides[0] == stride &&
           (apart < 0 ? -apart : apart) < (stride < 0 ? -stride : stride) &&
           memcmp(a->views[1].buf, b->views[1].buf, (size_t)a->n * 8) == 0;
}

static int
conflict(const Prepared *a, const Prepared *b)
{
    return a->bytes > 0 && b->bytes > 0 &&
           (overlap(a->writes, b->reads) || overlap(a->writes, b->writes) ||
            overlap(b->writes, a->reads));
}

/* Groups the copies that read parts of the same rows (each copy's `lead`: groups run in
 * the order of their first copies, a group row by row, each member's part of a row in
 * turn), where that lands what running the copies one after another lands: no two copies
 * of a group, and no two copies it runs in the other order, touch the same bytes with one
 * writing (else every copy runs alone, in turn). Row by row reads the source in its memory
 * order: a load into vLLM's blocks, copy by copy, read a staged page's layers 32 KiB at a
 * stride of 256 KiB and took 1.27-1.36x a memmove; row by row, 0.81-0.88x
 * (docs/internals.md). */
static void
group_rows(Prepared *ps, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        ps[i].lead = i;
        for (Py_ssize_t j = 0; j < i; j++) {
            if (ps[j].lead == j && same_rows(&ps[j], &ps[i])) {
                ps[i].lead = j;
                break;
            }
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        for (Py_ssize_t j = i + 1; j < count; j++) {
            /* j runs before i where its group's first copy comes first */
            int moved = ps[i].lead == ps[j].lead || ps[j].lead < ps[i].lead;
            if (moved && conflict(&ps[i], &ps[j])) {
                for (Py_ssize_t k = 0; k < count; k++) {
                    ps[k].lead = k;
                }
                return;
            }
        }
    }
}

/* Without the GIL: the group that copy `lead` leads, row by row. */
static void
run_group(const Prepared *ps, Py_ssize_t count, Py_ssize_t lead, CopyStores stores)
{
    for (Py_ssize_t r = 0; r < ps[lead].n; r++) {
        for (Py_ssize_t i = lead; i < count; i++) {
            if (ps[i].lead != lead) {
                continue;
            }
            const Py_buffer *src = &ps[i].views[0], *dst = &ps[i].views[2];
            const int64_t *src_rows = ps[i].views[1].buf, *dst_rows = ps[i].views[3].buf;
            copy_row(&ps[i].shape, (const char *)src->buf + src_rows[r] * src->strides[0],
                     (char *)dst->buf + dst_rows[r] * dst->strides[0], stores);
        }
    }
}

/* Without the GIL: every copy, its streamed stores visible before this returns. */
static void
run_stores(const Prepared *ps, Py_ssize_t count, CopyStores stores)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        if (ps[i].lead != i) {
            continue; /* ran with its group */
        }
        int alone = 1;
        for (Py_ssize_t j = i + 1; j < count && alone; j++) {
            alone = ps[j].lead != i;
        }
        if (alone) {
            run(&ps[i], stores);
        }
        else {
            run_group(ps, count, i, stores);
        }
    }
#if defined(__SSE2__)
    if (stores != COPY_CACHED) {
        _mm_sfence();
    }
#endif
}

/* Runs `count` prepared copies with the GIL released once. */
static void
run_all(const Prepared *ps, Py_ssize_t count)
{
    CopyStores stores = stores_for(ps, count);
    Py_BEGIN_ALLOW_THREADS;
    run_stores(ps, count, stores);
    Py_END_ALLOW_THREADS;
}

static void
release_all(Prepared *ps, Py_ssize_t count)
{
    if (ps == NULL) {
        return;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        release(&ps[i]);
    }
    PyMem_Free(ps);
}

/* Every (src, src_rows, dst, dst_rows) tuple of `copies` prepared, or NULL with the
 * error set and nothing held. */
static Prepared *
prepare_all(PyObject *copies, Py_ssize_t *count)
{
    PyObject *seq = PySequence_Fast(copies, "a sequence of copies is needed");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), ready = 0;
    Prepared *ps = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Prepared));
    if (ps == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; ready < n; ready++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, ready);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_Format(PyExc_TypeError, "copy %zd is not a (src, src_rows, dst, dst_rows) tuple",
                         ready);
            goto fail;
        }
        /* The tuple holds its items, and the sequence the tuple, while they are read; the
         * views then hold what they read. */
        if (prepare(&PyTuple_GET_ITEM(item, 0), &ps[ready]) < 0) {
            goto fail;
        }
    }
    Py_DECREF(seq);
    group_rows(ps, n);
    *count = n;
    return ps;
fail:
    release_all(ps, ready);
    Py_DECREF(seq);
    return NULL;
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
    group_rows(&p, 1);
    run_all(&p, 1);
    release(&p);
    Py_RETURN_NONE;
}

/* --- the copy queue ---------------------------------------------------------------
 * CopyQueue().submit(copies) checks every (src, src_rows, dst, dst_rows) tuple c as
 * copy_rows(*c) does, before a byte moves, then returns at once: the copies run later, in
 * the order submitted, on a thread of the queue's own that never takes the GIL. The
 * returned ticket says when they are done (done(), wait()). A copy thread in Python must
 * take the GIL back before its copy can say it ended: beside an engine's thread running
 * Python it waited 0.6-3.7 ms a save for it (docs/internals.md).
 *
 * The thread starts at the first submit, from the submitting thread, and inherits its CPU
 * affinity (the connector's copy thread has moved to the cores the forward leaves free). A
 * ticket holds its copies' buffers and its queue; the queue's thread reads a ticket only
 * while it is not done, and a ticket being freed first waits until it is, so the thread
 * never reads freed memory and never touches a Python object. */

#define COPY_THREAD_NAME "kvf-copy-queue" /* as top -H and /proc show it */

typedef struct CopyTicket CopyTicket;

typedef struct {
    PyObject_HEAD pthread_mutex_t lock;
    pthread_cond_t work;  /* a ticket queued, or stop */
    pthread_cond_t ended; /* a ticket done */
    CopyTicket *head;     /* queued, not yet taken (borrowed: see above) */
    CopyTicket *tail;
    int stop;
    int started;
    pid_t owner; /* the process the thread runs in: a forked child has no thread */
    pthread_t thread;
    atomic_int tid; /* the thread's kernel id, once it runs (0 before) */
} CopyQueue;

struct CopyTicket {
    PyObject_HEAD CopyQueue *queue; /* held */
    Prepared *ps;                   /* held views */
    Py_ssize_t count;
    CopyStores stores;
    CopyTicket *next; /* in the queue, under its lock */
    /* Written by the queue's thread before `done` is set (under the lock), read after. */
    int64_t started_ns, ended_ns, cpu_ns;
    atomic_int done;
};

static int64_t
clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *
queue_main(void *arg)
{
    CopyQueue *q = arg;
    atomic_store(&q->tid, (int)gettid());
    pthread_setname_np(pthread_self(), COPY_THREAD_NAME);
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (q->head == NULL && !q->stop) {
            pthread_cond_wait(&q->work, &q->lock);
        }
        CopyTicket *t = q->head;
        if (t == NULL) {
            break; /* stopped, nothing queued (a queued ticket holds its queue) */
        }
        q->head = t->next;
        if (q->head == NULL) {
            q->tail = NULL;
        }
        pthread_mutex_unlock(&q->lock);
        int64_t cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        t->started_ns = clock_ns(CLOCK_MONOTONIC);
        run_stores(t->ps, t->count, t->stores);
        t->ended_ns = clock_ns(CLOCK_MONOTONIC);
        t->cpu_ns = clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu;
        pthread_mutex_lock(&q->lock);
        atomic_store(&t->done, 1);
        pthread_cond_broadcast(&q->ended);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* The queue's thread, started once, with every signal blocked (Python handles them in its
 * main thread). -1 with the error set if it cannot start. */
static int
queue_start(CopyQueue *q)
{
    if (q->started) {
        if (q->owner != getpid()) {
            PyErr_SetString(PyExc_RuntimeError,
                            "CopyQueue: used in a forked child (its thread is in the parent)");
            return -1;
        }
        return 0;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&q->thread, NULL, queue_main, q);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    q->started = 1;
    q->owner = getpid();
    return 0;
}

static PyTypeObject CopyTicketType;

static PyObject *
queue_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "CopyQueue() takes no arguments");
        return NULL;
    }
    CopyQueue *q = (CopyQueue *)type->tp_alloc(type, 0);
    if (q == NULL) {
        return NULL;
    }
    atomic_init(&q->tid, 0);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* wait()'s deadline */
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->ended, &attr);
    pthread_condattr_destroy(&attr);
    return (PyObject *)q;
}

static void
queue_dealloc(CopyQueue *q)
{
    /* No ticket is left (each holds its queue): the thread waits for work, or never ran. */
    if (q->started && q->owner == getpid()) {
        pthread_mutex_lock(&q->lock);
        q->stop = 1;
        pthread_cond_signal(&q->work);
        pthread_mutex_unlock(&q->lock);
        Py_BEGIN_ALLOW_THREADS;
        pthread_join(q->thread, NULL);
        Py_END_ALLOW_THREADS;
    }
    if (!q->started || q->owner == getpid()) { /* a forked child's copy may be locked */
        pthread_cond_destroy(&q->work);
        pthread_cond_destroy(&q->ended);
        pthread_mutex_destroy(&q->lock);
    }
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* submit(copies) -> CopyTicket */
static PyObject *
queue_submit(CopyQueue *q, PyObject *copies)
{
    Py_ssize_t count = 0;
    Prepared *ps = prepare_all(copies, &count);
    if (ps == NULL) {
        return NULL;
    }
    if (queue_start(q) < 0) {
        release_all(ps, count);
        return NULL;
    }
    CopyTicket *t = PyObject_New(CopyTicket, &CopyTicketType);
    if (t == NULL) {
        release_all(ps, count);
        return NULL;
    }
    t->queue = (CopyQueue *)Py_NewRef(q);
    t->ps = ps;
    t->count = count;
    t->stores = stores_for(ps, count);
    t->next = NULL;
    t->started_ns = t->ended_ns = t->cpu_ns = 0;
    atomic_init(&t->done, 0);
    /* The thread holds the lock only to take or end a ticket, never across the GIL. */
    pthread_mutex_lock(&q->lock);
    if (q->tail == NULL) {
        q->head = t;
    }
    else {
        q->tail->next = t;
    }
    q->tail = t;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->lock);
    return (PyObject *)t;
}

/* Waits, without the GIL, until `t` is done or `deadline` (CLOCK_MONOTONIC; NULL: none)
 * passes; 1 if done. */
static int
ticket_wait_until(CopyTicket *t, const struct timespec *deadline)
{
    if (atomic_load(&t->done)) {
        return 1;
    }
    CopyQueue *q = t->queue;
    int done;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&q->lock);
    while (!(done = atomic_load(&t->done))) {
        int err = deadline == NULL ? pthread_cond_wait(&q->ended, &q->lock)
                                   : pthread_cond_timedwait(&q->ended, &q->lock, deadline);
        if (err != 0) { /* ETIMEDOUT */
            break;
        }
    }
    pthread_mutex_unlock(&q->lock);
    Py_END_ALLOW_THREADS;
    return done;
}

static void
ticket_dealloc(CopyTicket *t)
{
    /* The queue's thread may still read the buffers: they are released once it is done. In a
     * forked child no thread copies, and nothing is waited for. */
    if (t->queue->owner == getpid()) {
        ticket_wait_until(t, NULL);
    }
    release_all(t->ps, t->count);
    Py_DECREF(t->queue);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *
ticket_done(CopyTicket *t, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(atomic_load(&t->done));
}

/* wait(timeout=None) -> bool: True once done; False if `timeout` seconds passed first. */
static PyObject *
ticket_wait(CopyTicket *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        return PyErr_Format(PyExc_TypeError, "wait takes at most 1 argument, got %zd", nargs);
    }
    if (nargs == 0 || args[0] == Py_None) {
        return PyBool_FromLong(ticket_wait_until(t, NULL));
    }
    double timeout = PyFloat_AsDouble(args[0]);
    if (timeout == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (!(timeout >= 0.0) || !isfinite(timeout)) {
        return PyErr_Format(PyExc_ValueError,
                            "wait: timeout must be a finite number of seconds >= 0, got %R",
                            args[0]);
    }
    int64_t at = clock_ns(CLOCK_MONOTONIC) + (int64_t)(fmin(timeout, 1e9) * 1e9);
    struct timespec deadline = {.tv_sec = at / 1000000000, .tv_nsec = at % 1000000000};
    return PyBool_FromLong(ticket_wait_until(t, &deadline));
}

/* A time the queue's thread wrote, once done (None before: it may still be writing). */
static PyObject *
ticket_time(CopyTicket *t, void *which)
{
    if (!atomic_load(&t->done)) {
        Py_RETURN_NONE;
    }
    const int64_t *times[] = {&t->started_ns, &t->ended_ns, &t->cpu_ns};
    return PyLong_FromLongLong(*times[(intptr_t)which]);
}

static PyMethodDef ticket_methods[] = {
    {"done", (PyCFunction)ticket_done, METH_NOARGS, "done() -> bool: the copies have run"},
    {"wait", (PyCFunction)(void (*)(void))ticket_wait, METH_FASTCALL,
     "wait(timeout=None) -> bool: wait for the copies, up to timeout seconds"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ticket_times[] = {
    {"started_ns", (getter)ticket_time, NULL,
     "when the copies started (time.monotonic_ns()), once done; else None", (void *)0},
    {"ended_ns", (getter)ticket_time, NULL,
     "when the copies ended (time.monotonic_ns()), once done; else None", (void *)1},
    {"cpu_ns", (getter)ticket_time, NULL,
     "the queue thread's CPU time for the copies, once done; else None", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyTicketType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric.core.cache._copy.CopyTicket",
    .tp_basicsize = sizeof(CopyTicket),
    .tp_dealloc = (destructor)ticket_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The copies of one CopyQueue.submit: done() once they have run.",
    .tp_methods = ticket_methods,
    .tp_getset = ticket_times,
};

static PyMethodDef queue_methods[] = {
    {"submit", (PyCFunction)queue_submit, METH_O,
     "submit(copies) -> CopyTicket: copy_rows(*c) for each (src, src_rows, dst, dst_rows) "
     "tuple c, all checked first, run later, in order, on the queue's thread"},
    {NULL, NULL, 0, NULL},
};

/* The thread's kernel id, as threading.Thread.native_id: None until a submit has started it
 * and it has run, and in a forked child (the thread is the parent's). Read after a ticket
 * is done, it is set. */
static PyObject *
queue_native_id(CopyQueue *q, void *Py_UNUSED(closure))
{
    int tid = atomic_load(&q->tid);
    if (tid == 0 || q->owner != getpid()) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLong(tid);
}

static PyGetSetDef queue_getset[] = {
    {"native_id", (getter)queue_native_id, NULL,
     "the queue thread's kernel id (top -H, /proc/self/task), None before it runs", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvfabric.core.cache._copy.CopyQueue",
    .tp_basicsize = sizeof(CopyQueue),
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CopyQueue(): row copies run in order on a thread of its own, without the GIL.",
    .tp_methods = queue_methods,
    .tp_getset = queue_getset,
    .tp_new = queue_new,
};

static PyMethodDef copy_functions[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_copy_rows, METH_FASTCALL,
     "copy_rows(src, src_rows, dst, dst_rows): dst[dst_rows[i]] = src[src_rows[i]]"},
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
    if (PyType_Ready(&CopyQueueType) < 0 || PyType_Ready(&CopyTicketType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&copy_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "CopyQueue", (PyObject *)&CopyQueueType) < 0 ||
        PyModule_AddObjectRef(module, "CopyTicket", (PyObject *)&CopyTicketType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
