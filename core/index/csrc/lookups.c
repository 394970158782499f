/* Presence.lookup: each node slot's usable match for chained page keys, by the rule of
 * core/index/lookups.py (the reference; the differential tests hold the two equal).
 *
 * The candidates first: the slots that may match, each given a place (a local slot): with
 * full layers the FULL holders of page 0 (a match holds every page before its end), else
 * every holder of any page. The walk's codes are theirs alone, in their places, so its
 * cost goes with the keys' holders, not the table's slot count.
 *
 * Per page, the candidates' codes (chain) and their running AND from page 0 (prefix). With
 * full layers the walk stops where no open slot holds every page so far: no match goes
 * further. A node's FULL run from page 0 ends where its bit leaves the running AND; it
 * matches there if its SWA window holds too, else the fall-back scans shorter lengths
 * for every such node at once. Windows are ANDs of `window` pages, from per-block prefix
 * and suffix ANDs (van Herk): O(pages) whatever the window. All of it is word-wise over
 * the codes of SLOTS_PER_WORD slots (presence.h's CODE_ shifts bring a code's bit to bit 0):
 * a match is on the device where its run's FULL and its window's SWA bits say so, else in
 * memory where their memory bits do, else on disk. */
#include "presence.h"

#include <string.h>

typedef struct {
    Py_ssize_t W, len, window;
    const int32_t *order;                 /* local slot -> slot, ascending */
    const uint64_t *ones;                 /* W: bit 0 of every candidate's code */
    uint64_t *chain, *prefix, *pre, *suf; /* len * W each */
} Walk;

#define AT(a, i) ((a) + (size_t)(i) * (size_t)k->W)

/* win = AND of chain over [max(0, m - window), m); all ones without a window. */
static void
window_of(const Walk *k, Py_ssize_t m, uint64_t *win)
{
    for (Py_ssize_t i = 0; i < k->W; i++) {
        if (!k->window) {
            win[i] = ~0ULL;
        }
        else if (m <= k->window) {
            win[i] = AT(k->prefix, m - 1)[i];
        }
        else {
            win[i] = AT(k->suf, m - k->window)[i] & AT(k->pre, m - 1)[i];
        }
    }
}

static void
blocks(Walk *k)
{
    Py_ssize_t w = k->window, W = k->W;
    for (Py_ssize_t i = 0; i < k->len; i++) {
        for (Py_ssize_t j = 0; j < W; j++) {
            AT(k->pre, i)[j] = AT(k->chain, i)[j] & (i % w ? AT(k->pre, i - 1)[j] : ~0ULL);
        }
    }
    for (Py_ssize_t i = k->len - 1; i >= 0; i--) {
        for (Py_ssize_t j = 0; j < W; j++) {
            AT(k->suf, i)
            [j] = AT(k->chain, i)[j] &
                  (i % w != w - 1 && i + 1 < k->len ? AT(k->suf, i + 1)[j] : ~0ULL);
        }
    }
}

/* (slot, pages, tier) for every candidate bit of `nodes`: Tier's values, 0 on the device,
 * 1 in memory, 2 on disk. */
static int
emit(const Walk *k, PyObject *out, const uint64_t *nodes, const uint64_t *device,
     const uint64_t *memory, Py_ssize_t pages)
{
    for (Py_ssize_t j = 0; j < k->W; j++) {
        for (uint64_t x = nodes[j]; x; x &= x - 1) {
            int b = __builtin_ctzll(x);
            int tier = (device[j] >> b) & 1 ? 0 : (memory[j] >> b) & 1 ? 1 : 2;
            PyObject *t =
                Py_BuildValue("(ini)", k->order[j * SLOTS_PER_WORD + b / CODE_BITS], pages, tier);
            if (t == NULL || PyList_Append(out, t) < 0) {
                Py_XDECREF(t);
                return -1;
            }
            Py_DECREF(t);
        }
    }
    return 0;
}

static int
any(const uint64_t *a, Py_ssize_t W)
{
    for (Py_ssize_t j = 0; j < W; j++) {
        if (a[j]) {
            return 1;
        }
    }
    return 0;
}

static int
is_open(const Presence *p, Py_ssize_t slot)
{
    return (int)(p->ones[slot / SLOTS_PER_WORD] >> CODE_BITS * (slot % SLOTS_PER_WORD)) & 1;
}

static int
by_slot(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The cell of each key a match may reach, in p->found; how many. */
static Py_ssize_t
find_cells(Presence *p, PyObject *const *items, Py_ssize_t n)
{
    if (n > p->found_len) {
        const Cell **f = PyMem_Realloc(p->found, (size_t)n * sizeof(*f));
        if (f == NULL) {
            return PyErr_NoMemory(), -1;
        }
        p->found = f, p->found_len = n;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* the keys' misses overlap, not one after another */
        ord_prefetch(&p->held, (const uint8_t *)PyBytes_AS_STRING(items[i]));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        p->found[i] = kvf_find(p, (const uint8_t *)PyBytes_AS_STRING(items[i]));
        if (p->found[i] == NULL && p->has_full) {
            return i; /* a full match needs every page: none goes further */
        }
    }
    return n;
}

/* The candidates into p->order, ascending, and their places into p->local; how many. */
static Py_ssize_t
candidates(Presence *p, Py_ssize_t n)
{
    if (p->order_len < p->nslots) { /* at most every slot, once */
        int32_t *o = PyMem_Realloc(p->order, (size_t)p->nslots * sizeof(int32_t));
        if (o == NULL) {
            return PyErr_NoMemory(), -1;
        }
        p->order = o, p->order_len = p->nslots;
    }
    Py_ssize_t nl = 0;
    for (Py_ssize_t i = 0; i < (p->has_full ? (n ? 1 : 0) : n); i++) {
        if (p->found[i] == NULL) {
            continue;
        }
        for (Holders h = holders_of(p->found[i]); holders_next(&h);) {
            if ((h.code & 1 || !p->has_full) && is_open(p, h.slot) && p->local[h.slot] == -1) {
                p->local[h.slot] = 0; /* seen: its place comes after the sort */
                p->order[nl++] = (int32_t)h.slot;
            }
        }
    }
    qsort(p->order, (size_t)nl, sizeof(int32_t), by_slot);
    for (Py_ssize_t l = 0; l < nl; l++) {
        p->local[p->order[l]] = (int32_t)l;
    }
    return nl;
}

/* The candidates' codes of one cell into `row` (W words, zeroed). */
static void
local_row(const Presence *p, const Cell *c, Py_ssize_t nl, uint64_t *row)
{
    if (cell_dense(c) && nl < (Py_ssize_t)c->dense.holders) { /* fewer candidates: ask each */
        for (Py_ssize_t l = 0; l < nl; l++) {
            row[l / SLOTS_PER_WORD] |= (uint64_t)kvf_cell_get(c, p->order[l])
                                       << CODE_BITS * (l % SLOTS_PER_WORD);
        }
        return;
    }
    for (Holders h = holders_of(c); holders_next(&h);) {
        int32_t l = p->local[h.slot];
        if (l >= 0) {
            row[l / SLOTS_PER_WORD] |= (uint64_t)h.code << CODE_BITS * (l % SLOTS_PER_WORD);
        }
    }
}

/* The walk over the candidates' codes of `n` found cells: k->len pages may match. */
static int
walk(Presence *p, Walk *k, Py_ssize_t n, Py_ssize_t nl)
{
    Py_ssize_t W = (nl + SLOTS_PER_WORD - 1) / SLOTS_PER_WORD, need = (4 * n + 9) * W;
    if (need > p->scratch_len) {
        uint64_t *s = PyMem_Realloc(p->scratch, (size_t)need * 8);
        if (s == NULL) {
            return PyErr_NoMemory(), -1;
        }
        p->scratch = s, p->scratch_len = need;
    }
    uint64_t *ones = p->scratch;
    k->W = W, k->window = p->window, k->order = p->order, k->ones = ones, k->len = 0;
    k->chain = ones + W, k->prefix = k->chain + n * W, k->pre = k->prefix + n * W,
    k->suf = k->pre + n * W;
    for (Py_ssize_t j = 0; j < W; j++) {
        ones[j] = CODE_ONES;
    }
    if (nl % SLOTS_PER_WORD) {
        ones[W - 1] &= (1ULL << CODE_BITS * (nl % SLOTS_PER_WORD)) - 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t live = 0, *row = AT(k->chain, i), *pre = AT(k->prefix, i);
        memset(row, 0, (size_t)W * 8);
        if (p->found[i] != NULL) {
            local_row(p, p->found[i], nl, row);
        }
        for (Py_ssize_t j = 0; j < W; j++) {
            pre[j] = row[j] & (i ? pre[j - W] : ~0ULL);
            live |= pre[j] & ones[j];
        }
        if (p->has_full && !live) {
            break; /* no candidate holds every page so far */
        }
        k->len = i + 1;
    }
    if (k->window && k->len > k->window) {
        blocks(k);
    }
    return 0;
}

/* Nodes whose FULL run is exactly n pages: those whose window holds there match n; the
 * others join `pending`. */
static int
match_group(const Walk *k, Py_ssize_t n, const uint64_t *group, uint64_t *pending, uint64_t *win,
            uint64_t *ok, uint64_t *dev, uint64_t *mem, PyObject *out)
{
    window_of(k, n, win);
    for (Py_ssize_t j = 0; j < k->W; j++) {
        uint64_t run = AT(k->prefix, n - 1)[j];
        ok[j] = group[j] & (win[j] >> CODE_S_ANY);
        dev[j] = (run >> CODE_F_DEV) & (win[j] >> CODE_S_DEV);
        mem[j] = (run >> CODE_F_MEM) & (win[j] >> CODE_S_MEM);
        pending[j] |= group[j] & ~ok[j];
    }
    return emit(k, out, ok, dev, mem, n);
}

/* Nodes whose window fails where their run ends: the longest shorter length that holds. */
static int
fall_back(const Walk *k, int full, uint64_t *pending, uint64_t *win, uint64_t *hits, uint64_t *dev,
          uint64_t *mem, PyObject *out)
{
    for (Py_ssize_t m = k->len; m > 0 && any(pending, k->W); m--) {
        window_of(k, m, win);
        for (Py_ssize_t j = 0; j < k->W; j++) {
            uint64_t pre = full ? AT(k->prefix, m - 1)[j] : ~0ULL;
            hits[j] = pending[j] & (win[j] >> CODE_S_ANY) & pre;
            dev[j] = (pre >> CODE_F_DEV) & (win[j] >> CODE_S_DEV);
            mem[j] = (pre >> CODE_F_MEM) & (win[j] >> CODE_S_MEM);
            pending[j] ^= hits[j];
        }
        if (emit(k, out, hits, dev, mem, m) < 0) {
            return -1;
        }
    }
    return 0;
}

static int
rule(Presence *p, Walk *k, PyObject *out)
{
    Py_ssize_t W = k->W;
    uint64_t *t = k->suf + k->len * W; /* room for 8 * W after the per-page arrays */
    uint64_t *pending = t, *inner = t + W, *group = t + 2 * W, *win = t + 3 * W, *a = t + 4 * W,
             *b = t + 5 * W, *c = t + 6 * W;
    for (Py_ssize_t j = 0; j < W; j++) {
        pending[j] = p->has_full ? 0 : k->ones[j], inner[j] = 0;
    }
    for (Py_ssize_t i = k->len - 1; p->has_full && i >= 0;) { /* each FULL run, longest first */
        const uint64_t *v = AT(k->prefix, i);
        Py_ssize_t start = i;
        while (start > 0 && memcmp(AT(k->prefix, start - 1), v, (size_t)W * 8) == 0) {
            start--;
        }
        for (Py_ssize_t j = 0; j < W; j++) {
            group[j] = v[j] & k->ones[j] & ~inner[j];
            inner[j] = v[j] & k->ones[j];
        }
        if (any(group, W) && match_group(k, i + 1, group, pending, win, a, b, c, out) < 0) {
            return -1;
        }
        i = start - 1;
    }
    return any(pending, W) ? fall_back(k, p->has_full, pending, win, a, b, c, out) : 0;
}

PyObject *
kvf_lookup(Presence *p, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "lookup keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), found, nl = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq), *out = NULL;
    Walk k;
    if (kvf_check_keys(items, n, "lookup") == 0 && (found = find_cells(p, items, n)) >= 0 &&
        (nl = candidates(p, found)) >= 0 && (nl == 0 || walk(p, &k, found, nl) == 0)) {
        out = PyList_New(0);
        if (out != NULL && nl && k.len && rule(p, &k, out) < 0) {
            Py_CLEAR(out);
        }
    }
    for (Py_ssize_t l = 0; l < nl; l++) { /* the places are this lookup's alone */
        p->local[p->order[l]] = -1;
    }
    Py_DECREF(seq);
    return out;
}
