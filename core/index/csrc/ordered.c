/* An ordered set of 16-byte keys: the held keys of the presence table, and each slot's
 * pages. Open addressing over entry numbers, entries in insertion order; a delete
 * leaves a tombstone and a dead entry, which the next reserve that needs room compacts
 * away (live entries keep their order). */
#include "presence.h"

#include <string.h>

/* A fresh index over the entries 0..n-1 of `keys`, `size` positions; NULL if out of memory. */
static int32_t *
index_of(const uint8_t *keys, Py_ssize_t n, size_t size)
{
    int32_t *index = PyMem_Malloc(size * sizeof(int32_t));
    if (index == NULL) {
        return NULL;
    }
    memset(index, 0xff, size * sizeof(int32_t));
    for (Py_ssize_t e = 0; e < n; e++) {
        size_t i = ord_hash(keys + e * KEY_BYTES) & (size - 1);
        while (index[i] != -1) {
            i = (i + 1) & (size - 1);
        }
        index[i] = (int32_t)e;
    }
    return index;
}

/* No dead entries: every array grows in place (realloc keeps what is already mapped,
 * where a fresh copy would fault it all in again), and a fresh index if it must grow. */
static int
grow(Ordered *o, Py_ssize_t cap, size_t size, const Column *cols, int ncols)
{
    int32_t *index; /* each step leaves a consistent set: bigger arrays */
    uint8_t *keys = PyMem_Realloc(o->keys, (size_t)cap * KEY_BYTES);
    if (keys == NULL) {
        return PyErr_NoMemory(), -1;
    }
    o->keys = keys;
    uint8_t *dead = PyMem_Realloc(o->dead, (size_t)cap);
    if (dead == NULL) {
        return PyErr_NoMemory(), -1;
    }
    o->dead = dead;
    for (int c = 0; c < ncols; c++) {
        void *d = PyMem_Realloc(*cols[c].data, (size_t)cap * cols[c].size);
        if (d == NULL) {
            return PyErr_NoMemory(), -1;
        }
        *cols[c].data = d;
    }
    if (size != o->mask + 1 || o->index == NULL) { /* else the index has room as it is */
        if ((index = index_of(o->keys, o->used, size)) == NULL) {
            return PyErr_NoMemory(), -1;
        }
        PyMem_Free(o->index);
        o->index = index, o->mask = size - 1;
    }
    o->cap = cap;
    return 0;
}

int
kvf_ord_reserve(Ordered *o, Py_ssize_t extra, const Column *cols, int ncols)
{
    if (o->used + extra <= o->cap) {
        return 0;
    }
    Py_ssize_t need = o->live + extra, cap = o->cap;
    if (need * 2 > cap) { /* else compacting the dead entries makes room */
        cap = need > cap + cap / 2 ? need : cap + cap / 2; /* 1.5x: less idle room */
    }
    if (cap < 8) {
        cap = 8;
    }
    if ((size_t)cap > (size_t)INT32_MAX / 2 || ncols > 8) {
        return PyErr_NoMemory(), -1;
    }
    size_t size = 16;
    while (size < (size_t)cap * 2) {
        size <<= 1;
    }
    if (o->live == o->used) {
        return grow(o, cap, size, cols, ncols);
    }
    void *fresh[8] = {NULL};
    uint8_t *keys = PyMem_Malloc((size_t)cap * KEY_BYTES), *dead = PyMem_Calloc((size_t)cap, 1);
    int ok = keys && dead;
    for (int c = 0; ok && c < ncols; c++) {
        ok = (fresh[c] = PyMem_Malloc((size_t)cap * cols[c].size)) != NULL;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t e = 0; ok && e < o->used; e++) {
        if (o->dead[e]) {
            continue;
        }
        memcpy(keys + n * KEY_BYTES, o->keys + e * KEY_BYTES, KEY_BYTES);
        for (int c = 0; c < ncols; c++) {
            memcpy((uint8_t *)fresh[c] + (size_t)n * cols[c].size,
                   (uint8_t *)*cols[c].data + (size_t)e * cols[c].size, cols[c].size);
        }
        n++;
    }
    int32_t *index = ok ? index_of(keys, n, size) : NULL;
    if (index == NULL) {
        PyMem_Free(keys), PyMem_Free(dead);
        for (int c = 0; c < ncols; c++) {
            PyMem_Free(fresh[c]);
        }
        return PyErr_NoMemory(), -1;
    }
    PyMem_Free(o->keys), PyMem_Free(o->dead), PyMem_Free(o->index);
    for (int c = 0; c < ncols; c++) {
        PyMem_Free(*cols[c].data);
        *cols[c].data = fresh[c];
    }
    o->keys = keys, o->dead = dead, o->index = index, o->mask = size - 1;
    o->used = o->live = n, o->cap = cap;
    return 0;
}

Py_ssize_t
kvf_ord_add(Ordered *o, size_t pos, const uint8_t *key)
{
    Py_ssize_t e = o->used++;
    o->live++;
    o->index[pos] = (int32_t)e;
    o->dead[e] = 0;
    memcpy(o->keys + e * KEY_BYTES, key, KEY_BYTES);
    return e;
}

void
kvf_ord_remove(Ordered *o, size_t pos)
{
    o->dead[o->index[pos]] = 1;
    o->index[pos] = -2;
    o->live--;
}

void
kvf_ord_free(Ordered *o, const Column *cols, int ncols)
{
    PyMem_Free(o->keys), PyMem_Free(o->dead), PyMem_Free(o->index);
    for (int c = 0; c < ncols; c++) {
        PyMem_Free(*cols[c].data);
        *cols[c].data = NULL;
    }
    memset(o, 0, sizeof(*o));
}
