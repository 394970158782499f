/* Presence.lookup: each node slot's usable match for chained page keys, by the rule of
 * fabric/index/lookups.py (the reference; the differential tests hold the two equal).
 *
 * Per page, the holders' nibbles (chain) and their running AND from page 0 (prefix). With
 * full layers the walk stops where no open slot holds every page so far: no match goes
 * further. A node's FULL run from page 0 ends where its bit leaves the running AND; it
 * matches there if its SWA window holds too, else the fall-back scans shorter lengths
 * for every such node at once. Windows are ANDs of `window` pages, from per-block prefix
 * and suffix ANDs (van Herk): O(pages) whatever the window. All of it is word-wise over
 * the nibbles of 16 slots: bit 0 of a slot's nibble is FULL, 1 FULL on device, 2 SWA,
 * 3 SWA on device, so `>> 2` and `>> 3` bring a window's SWA bits to bit 0. */
#include "presence.h"

#include <string.h>

typedef struct {
    Py_ssize_t W, len, window;
    const uint64_t *ones;
    uint64_t *chain, *prefix, *pre, *suf;    /* len * W each */
} Walk;

#define AT(a, i) ((a) + (size_t)(i) * (size_t)k->W)

/* win = AND of chain over [max(0, m - window), m); all ones without a window. */
static void window_of(const Walk *k, Py_ssize_t m, uint64_t *win) {
    for (Py_ssize_t i = 0; i < k->W; i++) {
        if (!k->window)
            win[i] = ~0ULL;
        else if (m <= k->window)
            win[i] = AT(k->prefix, m - 1)[i];
        else
            win[i] = AT(k->suf, m - k->window)[i] & AT(k->pre, m - 1)[i];
    }
}

static void blocks(Walk *k) {
    Py_ssize_t w = k->window, W = k->W;
    for (Py_ssize_t i = 0; i < k->len; i++)
        for (Py_ssize_t j = 0; j < W; j++)
            AT(k->pre, i)[j] = AT(k->chain, i)[j] & (i % w ? AT(k->pre, i - 1)[j] : ~0ULL);
    for (Py_ssize_t i = k->len - 1; i >= 0; i--)
        for (Py_ssize_t j = 0; j < W; j++)
            AT(k->suf, i)[j] = AT(k->chain, i)[j] & (i % w != w - 1 && i + 1 < k->len ? AT(k->suf, i + 1)[j] : ~0ULL);
}

/* (slot, pages, device) for every node bit of `nodes`. */
static int emit(PyObject *out, const uint64_t *nodes, const uint64_t *device, Py_ssize_t W, Py_ssize_t pages) {
    for (Py_ssize_t j = 0; j < W; j++)
        for (uint64_t x = nodes[j]; x; x &= x - 1) {
            int b = __builtin_ctzll(x);
            PyObject *t = Py_BuildValue("(nnO)", j * SLOTS_PER_WORD + b / 4, pages,
                                        (device[j] >> b) & 1 ? Py_True : Py_False);
            if (t == NULL || PyList_Append(out, t) < 0) {
                Py_XDECREF(t);
                return -1;
            }
            Py_DECREF(t);
        }
    return 0;
}

static int any(const uint64_t *a, Py_ssize_t W) {
    for (Py_ssize_t j = 0; j < W; j++)
        if (a[j])
            return 1;
    return 0;
}

/* The walk over the keys' nibbles: k->len pages may match (0: none). */
static int walk(Presence *p, Walk *k, PyObject *const *items, Py_ssize_t n) {
    Py_ssize_t W = p->words, need = (4 * n + 8) * W;
    if (need > p->scratch_len) {
        uint64_t *s = PyMem_Realloc(p->scratch, (size_t)need * 8);
        if (s == NULL)
            return PyErr_NoMemory(), -1;
        p->scratch = s, p->scratch_len = need;
    }
    k->W = W, k->window = p->window, k->ones = p->ones, k->len = 0;
    k->chain = p->scratch, k->prefix = k->chain + n * W, k->pre = k->prefix + n * W, k->suf = k->pre + n * W;
    for (Py_ssize_t i = 0; i < n; i++)  /* the keys' misses overlap, not one after another */
        ord_prefetch(&p->held, (const uint8_t *)PyBytes_AS_STRING(items[i]));
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t *bits = kvf_find(p, (const uint8_t *)PyBytes_AS_STRING(items[i]));
        if (bits == NULL && p->has_full)
            break;                       /* a full match needs every page: none goes further */
        uint64_t live = 0;
        for (Py_ssize_t j = 0; j < W; j++) {
            AT(k->chain, i)[j] = bits ? bits[j] : 0;
            AT(k->prefix, i)[j] = AT(k->chain, i)[j] & (i ? AT(k->prefix, i - 1)[j] : ~0ULL);
            live |= AT(k->prefix, i)[j] & p->ones[j];
        }
        if (p->has_full && !live)
            break;                       /* no open slot holds every page so far */
        k->len = i + 1;
    }
    if (k->window && k->len > k->window)
        blocks(k);
    return 0;
}

/* Nodes whose FULL run is exactly n pages: those whose window holds there match n; the
 * others join `pending`. */
static int match_group(const Walk *k, Py_ssize_t n, const uint64_t *group, uint64_t *pending,
                       uint64_t *win, uint64_t *ok, uint64_t *dev, PyObject *out) {
    window_of(k, n, win);
    for (Py_ssize_t j = 0; j < k->W; j++) {
        ok[j] = group[j] & (win[j] >> 2);
        dev[j] = (AT(k->prefix, n - 1)[j] >> 1) & (win[j] >> 3);
        pending[j] |= group[j] & ~ok[j];
    }
    return emit(out, ok, dev, k->W, n);
}

/* Nodes whose window fails where their run ends: the longest shorter length that holds. */
static int fall_back(const Walk *k, int full, uint64_t *pending, uint64_t *win, uint64_t *hits,
                     uint64_t *dev, PyObject *out) {
    for (Py_ssize_t m = k->len; m > 0 && any(pending, k->W); m--) {
        window_of(k, m, win);
        for (Py_ssize_t j = 0; j < k->W; j++) {
            uint64_t pre = full ? AT(k->prefix, m - 1)[j] : ~0ULL;
            hits[j] = pending[j] & (win[j] >> 2) & pre;
            dev[j] = (pre >> 1) & (win[j] >> 3);
            pending[j] ^= hits[j];
        }
        if (emit(out, hits, dev, k->W, m) < 0)
            return -1;
    }
    return 0;
}

static int rule(Presence *p, Walk *k, PyObject *out) {
    Py_ssize_t W = k->W;
    uint64_t *t = k->suf + k->len * W;    /* room for 8 * W after the per-page arrays */
    uint64_t *pending = t, *inner = t + W, *group = t + 2 * W, *win = t + 3 * W, *a = t + 4 * W,
             *b = t + 5 * W;
    for (Py_ssize_t j = 0; j < W; j++)
        pending[j] = p->has_full ? 0 : p->ones[j], inner[j] = 0;
    for (Py_ssize_t i = k->len - 1; p->has_full && i >= 0;) {   /* each FULL run, longest first */
        const uint64_t *v = AT(k->prefix, i);
        Py_ssize_t start = i;
        while (start > 0 && memcmp(AT(k->prefix, start - 1), v, (size_t)W * 8) == 0)
            start--;
        for (Py_ssize_t j = 0; j < W; j++) {
            group[j] = v[j] & k->ones[j] & ~inner[j];
            inner[j] = v[j] & k->ones[j];
        }
        if (any(group, W) && match_group(k, i + 1, group, pending, win, a, b, out) < 0)
            return -1;
        i = start - 1;
    }
    return any(pending, W) ? fall_back(k, p->has_full, pending, win, a, b, out) : 0;
}

PyObject *kvf_lookup(Presence *p, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "lookup keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq), *out = NULL;
    Walk k;
    if (kvf_check_keys(items, n, "lookup") == 0 && walk(p, &k, items, n) == 0) {
        out = PyList_New(0);
        if (out != NULL && k.len && rule(p, &k, out) < 0)
            Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}
