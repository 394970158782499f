/* What the index keeps per slot and per key, beside the codes: a chain's apply (the
 * codes, the slot's pages and the keys' last records in one pass), a slot's clear,
 * and the reads of both. Arguments come checked from presence.c; room is reserved
 * before anything is written, so an apply happens whole or not at all.
 *
 * A slot's page keeps only its mask: its parent and depth are its key's last record
 * (held), as keys are chained hashes and every node states the same of a key. When a
 * publication changes a key's record, the other slots holding the key keep the old one
 * as their own (Pages.own, the OWN bit of their mask) before it changes. */
#include "presence.h"

#include <string.h>

#define OWN 0x80 /* the page's parent and depth are in Pages.own */

/* A PageMask as its code: FULL on any tier, FULL on device, SWA on any, SWA on device, FULL
 * in memory, SWA in memory (presence.code: the bits AND sensibly along a path). */
static int
code_of(int mask)
{
    return (mask & 19 ? 1 : 0) | (mask & 1 ? 2 : 0) | (mask & 44 ? 4 : 0) | (mask & 4 ? 8 : 0) |
           (mask & 3 ? 16 : 0) | (mask & 12 ? 32 : 0);
}

static int
reserve_held(Presence *p, Py_ssize_t extra)
{
    Column cols[] = {{(void **)&p->cells, sizeof(Cell)},
                     {(void **)&p->parents, KEY_BYTES},
                     {(void **)&p->depths, 8}};
    return kvf_ord_reserve(&p->held, extra, cols, 3);
}

static int
reserve_pages(Pages *s, Py_ssize_t extra)
{
    Column cols[] = {{(void **)&s->masks, 1}};
    return kvf_ord_reserve(&s->set, extra, cols, 1);
}

static int
reserve_own(Pages *s, Py_ssize_t extra)
{
    Column cols[] = {{(void **)&s->parents, KEY_BYTES}, {(void **)&s->depths, 8}};
    return kvf_ord_reserve(&s->own, extra, cols, 2);
}

void
kvf_free_pages(Pages *s)
{
    Column cols[] = {{(void **)&s->masks, 1}},
           own[] = {{(void **)&s->parents, KEY_BYTES}, {(void **)&s->depths, 8}};
    kvf_ord_free(&s->set, cols, 1);
    kvf_ord_free(&s->own, own, 2);
}

/* The slot's code of `key` cleared; the key is deleted when no slot holds it. */
static void
drop_holder(Presence *p, const uint8_t *key, Py_ssize_t slot)
{
    size_t pos;
    Py_ssize_t e = ord_find(&p->held, key, &pos);
    if (e >= 0 && kvf_cell_drop(&p->cells[e], slot, &p->dense_words) == 0) {
        kvf_ord_remove(&p->held, pos); /* an empty cell is inline: nothing to free */
    }
}

/* The page of `key` leaves the slot (its own record too). */
static void
drop_page(Pages *s, const uint8_t *key)
{
    size_t pos, at;
    Py_ssize_t f = ord_find(&s->set, key, &pos);
    if (f < 0) {
        return;
    }
    if (s->masks[f] & OWN && ord_find(&s->own, key, &at) >= 0) {
        kvf_ord_remove(&s->own, at);
    }
    kvf_ord_remove(&s->set, pos);
}

static int
differs(const Presence *p, Py_ssize_t e, const uint8_t *parent, uint64_t depth)
{
    return p->depths[e] != depth || memcmp(p->parents + e * KEY_BYTES, parent, KEY_BYTES) != 0;
}

/* Every other holder of entry e whose page relies on e's record keeps it as its own. */
static void
keep_old_record(Presence *p, Py_ssize_t e, Py_ssize_t slot, const uint8_t *key)
{
    for (Holders h = holders_of(&p->cells[e]); holders_next(&h);) {
        Py_ssize_t t = h.slot;
        Pages *o = &p->slots[t];
        size_t pos;
        Py_ssize_t f = t == slot ? -1 : ord_find(&o->set, key, &pos);
        if (f < 0 || o->masks[f] & OWN) {
            continue;
        }
        Py_ssize_t g = ord_find(&o->own, key, &pos);
        if (g < 0) {
            g = kvf_ord_add(&o->own, pos, key); /* reserved by reserve_others */
        }
        memcpy(o->parents + g * KEY_BYTES, p->parents + e * KEY_BYTES, KEY_BYTES);
        o->depths[g] = p->depths[e];
        o->masks[f] |= OWN;
    }
}

/* Each key's place in `held` (p->places), found once for the whole apply, and room made
 * before anything changes: in every held key's cell for the slot's code (a cell that
 * must go dense or wider does so now, its holders the same), and in every other holder's
 * `own` for the records this chain would change under them (an upper bound: a holder
 * may have its own record already). */
static int
find_places(Presence *p, Py_ssize_t slot, PyObject *const *keys, Py_ssize_t n,
            uint64_t first_depth, const uint8_t *parent)
{
    if (n > p->places_len) {
        Place *at = PyMem_Realloc(p->places, (size_t)n * sizeof(Place));
        if (at == NULL) {
            return PyErr_NoMemory(), -1;
        }
        p->places = at, p->places_len = n;
    }
    Py_ssize_t *need = NULL;
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        Place *at = &p->places[i];
        at->entry = ord_find(&p->held, (const uint8_t *)PyBytes_AS_STRING(keys[i]), &at->pos);
        Py_ssize_t e = at->entry;
        if (e < 0) {
            continue;
        }
        if (kvf_cell_room(&p->cells[e], slot, &p->dense_words) < 0) {
            rc = -1;
        }
        const uint8_t *par = i ? (const uint8_t *)PyBytes_AS_STRING(keys[i - 1]) : parent;
        if (rc < 0 || !differs(p, e, par, first_depth + (uint64_t)i)) {
            continue;
        }
        if (need == NULL && (need = PyMem_Calloc((size_t)p->nslots, sizeof(Py_ssize_t))) == NULL) {
            return PyErr_NoMemory(), -1;
        }
        for (Holders h = holders_of(&p->cells[e]); holders_next(&h);) {
            need[h.slot]++;
        }
    }
    for (Py_ssize_t t = 0; need != NULL && rc == 0 && t < p->nslots; t++) {
        if (t != slot && need[t]) {
            rc = reserve_own(&p->slots[t], need[t]);
        }
    }
    PyMem_Free(need);
    return rc;
}

/* The entry of key i of the chain, added if new, from its place found before the apply:
 * an entry found stays (an apply removes none); a place found free stays right while it
 * is free (adds only fill free positions, so the positions before it are as they were),
 * else a key of this chain took it (this key itself, if listed twice) and we look again. */
static Py_ssize_t
entry_at(Presence *p, const Place *at, const uint8_t *key, int *added)
{
    size_t pos = at->pos;
    Py_ssize_t e = at->entry;
    *added = 0;
    if (e >= 0) {
        return e;
    }
    if (p->held.index[pos] >= 0 && (e = ord_find(&p->held, key, &pos)) >= 0) {
        return e;
    }
    *added = 1;
    return kvf_ord_add(&p->held, pos, key);
}

int
kvf_set_chain(Presence *p, Pages *s, Py_ssize_t slot, PyObject *const *keys, Py_ssize_t n,
              uint64_t first_depth, const uint8_t *parent, int mask)
{
    int code = code_of(mask);
    for (Py_ssize_t i = 0; i < n; i++) { /* the keys' misses overlap, not one after another */
        ord_prefetch(&s->set, (const uint8_t *)PyBytes_AS_STRING(keys[i]));
        ord_prefetch(&p->held, (const uint8_t *)PyBytes_AS_STRING(keys[i]));
    }
    if (!mask) {
        for (Py_ssize_t i = 0; i < n; i++) {
            drop_page(s, (const uint8_t *)PyBytes_AS_STRING(keys[i]));
            drop_holder(p, (const uint8_t *)PyBytes_AS_STRING(keys[i]), slot);
        }
        return 0;
    }
    /* reserves first: they may compact or grow `held`, which moves entries and places */
    if (reserve_held(p, n) < 0 || reserve_pages(s, n) < 0 ||
        find_places(p, slot, keys, n, first_depth, parent) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(keys[i]);
        const uint8_t *par = i ? (const uint8_t *)PyBytes_AS_STRING(keys[i - 1]) : parent;
        uint64_t depth = first_depth + (uint64_t)i;
        int added;
        Py_ssize_t e = entry_at(p, &p->places[i], key, &added);
        if (added) {
            memset(&p->cells[e], 0, sizeof(Cell)); /* no holders: inline, room for one */
        }
        else if (differs(p, e, par, depth)) {
            keep_old_record(p, e, slot, key);
        }
        kvf_cell_set(&p->cells[e], slot, code);
        memcpy(p->parents + e * KEY_BYTES, par, KEY_BYTES);
        p->depths[e] = depth;
        size_t pos = 0;
        Py_ssize_t f = ord_find(&s->set, key, &pos);
        if (f < 0) {
            f = kvf_ord_add(&s->set, pos, key);
        }
        else if (s->masks[f] & OWN) { /* it states the key's record now */
            size_t at;
            if (ord_find(&s->own, key, &at) >= 0) {
                kvf_ord_remove(&s->own, at);
            }
        }
        s->masks[f] = (uint8_t)mask;
    }
    return 0;
}

void
kvf_clear(Presence *p, Pages *s, Py_ssize_t slot)
{
    for (Py_ssize_t f = 0; f < s->set.used; f++) {
        if (!s->set.dead[f]) {
            drop_holder(p, s->set.keys + f * KEY_BYTES, slot);
        }
    }
    kvf_free_pages(s); /* a cleared node's memory goes back */
}

PyObject *
kvf_pages(Presence *p, Pages *s)
{
    PyObject *out = PyList_New(s->set.live);
    Py_ssize_t n = 0;
    for (Py_ssize_t f = 0; out != NULL && f < s->set.used; f++) {
        if (s->set.dead[f]) {
            continue;
        }
        const uint8_t *key = s->set.keys + f * KEY_BYTES, *parent;
        uint64_t depth;
        size_t pos;
        Py_ssize_t g = s->masks[f] & OWN ? ord_find(&s->own, key, &pos) : -1;
        Py_ssize_t e = g < 0 ? ord_find(&p->held, key, &pos) : -1;
        if (g < 0 && e < 0) { /* a held page's key is held: never, but not a crash */
            PyErr_SetString(PyExc_SystemError, "index core: a page without its key's record");
            Py_CLEAR(out);
            break;
        }
        parent = g >= 0 ? s->parents + g * KEY_BYTES : p->parents + e * KEY_BYTES;
        depth = g >= 0 ? s->depths[g] : p->depths[e];
        PyObject *t = Py_BuildValue("(y#y#Ki)", (const char *)key, (Py_ssize_t)KEY_BYTES,
                                    (const char *)parent, (Py_ssize_t)KEY_BYTES,
                                    (unsigned long long)depth, (int)(s->masks[f] & ~OWN));
        if (t == NULL) {
            Py_CLEAR(out);
        }
        else {
            PyList_SET_ITEM(out, n++, t);
        }
    }
    return out;
}

PyObject *
kvf_meta(Presence *p, const uint8_t *key)
{
    size_t pos;
    Py_ssize_t e = ord_find(&p->held, key, &pos);
    if (e < 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(y#K)", (const char *)p->parents + e * KEY_BYTES, (Py_ssize_t)KEY_BYTES,
                         (unsigned long long)p->depths[e]);
}

void
kvf_free_held(Presence *p)
{
    for (Py_ssize_t e = 0; e < p->held.used; e++) { /* dead entries' cells are empty */
        if (!p->held.dead[e]) {
            kvf_cell_free(&p->cells[e], &p->dense_words);
        }
    }
    Column cols[] = {{(void **)&p->cells, sizeof(Cell)},
                     {(void **)&p->parents, KEY_BYTES},
                     {(void **)&p->depths, 8}};
    kvf_ord_free(&p->held, cols, 3);
}
