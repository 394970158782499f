/* What the index keeps per slot and per key, beside the nibbles: a chain's apply (the
 * nibbles, the slot's pages and the keys' last records in one pass), a slot's clear,
 * and the reads of both. Arguments come checked from presence.c; room is reserved
 * before anything is written, so an apply happens whole or not at all. */
#include "presence.h"

#include <string.h>

/* A PageMask as its nibble: FULL on either tier, FULL on device, SWA on either, SWA on
 * device (presence.code: the bits AND sensibly along a path). */
static int code_of(int mask) {
    return (mask & 3 ? 1 : 0) | (mask & 1 ? 2 : 0) | (mask & 12 ? 4 : 0) | (mask & 4 ? 8 : 0);
}

static int reserve_held(Presence *p, Py_ssize_t extra) {
    Column cols[] = {{(void **)&p->bits, (size_t)p->words * 8}, {(void **)&p->parents, KEY_BYTES},
                     {(void **)&p->depths, 8}};
    return ord_reserve(&p->held, extra, cols, 3);
}

static int reserve_pages(Pages *s, Py_ssize_t extra) {
    Column cols[] = {{(void **)&s->parents, KEY_BYTES}, {(void **)&s->depths, 8}, {(void **)&s->masks, 1}};
    return ord_reserve(&s->set, extra, cols, 3);
}

void kvf_free_pages(Pages *s) {
    Column cols[] = {{(void **)&s->parents, KEY_BYTES}, {(void **)&s->depths, 8}, {(void **)&s->masks, 1}};
    ord_free(&s->set, cols, 3);
}

static int is_zero(const uint64_t *w, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (w[i])
            return 0;
    return 1;
}

/* The slot's nibble of `key` cleared; the key is deleted when no slot holds it. */
static void drop_holder(Presence *p, const uint8_t *key, Py_ssize_t word, uint64_t keep) {
    size_t pos;
    Py_ssize_t e = ord_find(&p->held, key, &pos);
    if (e < 0)
        return;
    uint64_t *bits = p->bits + e * p->words;
    bits[word] &= keep;
    if (is_zero(bits, p->words))
        ord_remove(&p->held, pos);
}

int kvf_set_chain(Presence *p, Pages *s, Py_ssize_t slot, PyObject *const *keys, Py_ssize_t n,
                  uint64_t first_depth, const uint8_t *parent, int mask) {
    Py_ssize_t word = slot / SLOTS_PER_WORD, w = p->words;
    int shift = 4 * (int)(slot % SLOTS_PER_WORD);
    uint64_t keep = ~(0xFULL << shift), put = (uint64_t)code_of(mask) << shift;
    if (mask && (reserve_held(p, n) < 0 || reserve_pages(s, n) < 0))
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {  /* the keys' misses overlap, not one after another */
        ord_prefetch(&s->set, (const uint8_t *)PyBytes_AS_STRING(keys[i]));
        ord_prefetch(&p->held, (const uint8_t *)PyBytes_AS_STRING(keys[i]));
    }
    size_t pos;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(keys[i]);
        Py_ssize_t f = ord_find(&s->set, key, &pos);
        if (!mask) {
            if (f >= 0)
                ord_remove(&s->set, pos);
            drop_holder(p, key, word, keep);
            continue;
        }
        const uint8_t *par = i ? (const uint8_t *)PyBytes_AS_STRING(keys[i - 1]) : parent;
        uint64_t depth = first_depth + (uint64_t)i;
        if (f < 0)
            f = ord_add(&s->set, pos, key);
        memcpy(s->parents + f * KEY_BYTES, par, KEY_BYTES);
        s->depths[f] = depth, s->masks[f] = (uint8_t)mask;
        Py_ssize_t e = ord_find(&p->held, key, &pos);
        if (e < 0) {
            e = ord_add(&p->held, pos, key);
            memset(p->bits + e * w, 0, (size_t)w * 8);
        }
        p->bits[e * w + word] = (p->bits[e * w + word] & keep) | put;
        memcpy(p->parents + e * KEY_BYTES, par, KEY_BYTES);
        p->depths[e] = depth;
    }
    return 0;
}

void kvf_clear(Presence *p, Pages *s, Py_ssize_t slot) {
    Py_ssize_t word = slot / SLOTS_PER_WORD;
    uint64_t keep = ~(0xFULL << 4 * (slot % SLOTS_PER_WORD));
    for (Py_ssize_t f = 0; f < s->set.used; f++)
        if (!s->set.dead[f])
            drop_holder(p, s->set.keys + f * KEY_BYTES, word, keep);
    kvf_free_pages(s);                  /* a cleared node's memory goes back */
}

PyObject *kvf_pages(Pages *s) {
    PyObject *out = PyList_New(s->set.live);
    Py_ssize_t n = 0;
    for (Py_ssize_t f = 0; out != NULL && f < s->set.used; f++) {
        if (s->set.dead[f])
            continue;
        PyObject *t = Py_BuildValue("(y#y#Ki)", (const char *)s->set.keys + f * KEY_BYTES,
                                    (Py_ssize_t)KEY_BYTES, (const char *)s->parents + f * KEY_BYTES,
                                    (Py_ssize_t)KEY_BYTES, (unsigned long long)s->depths[f],
                                    (int)s->masks[f]);
        if (t == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, n++, t);
    }
    return out;
}

PyObject *kvf_meta(Presence *p, const uint8_t *key) {
    size_t pos;
    Py_ssize_t e = ord_find(&p->held, key, &pos);
    if (e < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(y#K)", (const char *)p->parents + e * KEY_BYTES, (Py_ssize_t)KEY_BYTES,
                         (unsigned long long)p->depths[e]);
}

void kvf_free_held(Presence *p) {
    Column cols[] = {{(void **)&p->bits, (size_t)p->words * 8}, {(void **)&p->parents, KEY_BYTES},
                     {(void **)&p->depths, 8}};
    ord_free(&p->held, cols, 3);
}
