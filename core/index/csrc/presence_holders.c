/* A key's holders (Cell, presence.h): inline pairs while few slots hold the key, a bitset
 * of codes where many do. Memory per key is then 16 bytes whatever the slot count,
 * except for the few keys many slots hold, whose bitset costs a byte per slot up
 * to the highest holder. The switch points are presence.py's, so that both cores say
 * the same of every key (the differential tests compare the forms too). */
#include "presence.h"

#include <stddef.h>
#include <string.h>

_Static_assert(sizeof(Cell) == 16, "a key's holders take 16 bytes");
_Static_assert(offsetof(Cell, pairs.n) == offsetof(Cell, dense.tag), "one tag byte");

static int
find_pair(const Cell *c, Py_ssize_t slot)
{
    for (int i = 0; i < c->pairs.n; i++) {
        if (c->pairs.slot[i] == slot) {
            return i;
        }
    }
    return -1;
}

int
kvf_cell_get(const Cell *c, Py_ssize_t slot)
{
    if (!cell_dense(c)) {
        int i = find_pair(c, slot);
        return i < 0 ? 0 : c->pairs.code[i];
    }
    Py_ssize_t w = slot / SLOTS_PER_WORD;
    return w < c->dense.words
               ? (int)(c->dense.bits[w] >> CODE_BITS * (slot % SLOTS_PER_WORD) & CODE_MASK)
               : 0;
}

int
kvf_cell_room(Cell *c, Py_ssize_t slot, Py_ssize_t *dense_words)
{
    Py_ssize_t need = slot / SLOTS_PER_WORD + 1;
    if (cell_dense(c)) {
        if (need <= c->dense.words) {
            return 0;
        }
        uint64_t *bits = PyMem_Realloc(c->dense.bits, (size_t)need * 8);
        if (bits == NULL) {
            return PyErr_NoMemory(), -1;
        }
        memset(bits + c->dense.words, 0, (size_t)(need - c->dense.words) * 8);
        *dense_words += need - c->dense.words;
        c->dense.bits = bits, c->dense.words = (uint16_t)need;
        return 0;
    }
    if (c->pairs.n < SPARSE_MAX || find_pair(c, slot) >= 0) {
        return 0;
    }
    for (int i = 0; i < c->pairs.n; i++) { /* full: the pairs move to a bitset */
        if (c->pairs.slot[i] / SLOTS_PER_WORD + 1 > need) {
            need = c->pairs.slot[i] / SLOTS_PER_WORD + 1;
        }
    }
    uint64_t *bits = PyMem_Calloc((size_t)need, 8);
    if (bits == NULL) {
        return PyErr_NoMemory(), -1;
    }
    for (int i = 0; i < c->pairs.n; i++) {
        int s = c->pairs.slot[i];
        bits[s / SLOTS_PER_WORD] |= (uint64_t)c->pairs.code[i] << CODE_BITS * (s % SLOTS_PER_WORD);
    }
    uint32_t holders = c->pairs.n;
    memset(c, 0, sizeof(*c));
    c->dense.bits = bits, c->dense.holders = holders, c->dense.words = (uint16_t)need;
    c->dense.tag = DENSE;
    *dense_words += need;
    return 0;
}

void
kvf_cell_set(Cell *c, Py_ssize_t slot, int code)
{
    if (cell_dense(c)) { /* cell_room made it wide enough */
        uint64_t *w = c->dense.bits + slot / SLOTS_PER_WORD;
        int shift = CODE_BITS * (int)(slot % SLOTS_PER_WORD);
        c->dense.holders += !((*w >> shift) & CODE_MASK);
        *w = (*w & ~(CODE_MASK << shift)) | (uint64_t)code << shift;
        return;
    }
    int i = find_pair(c, slot);
    if (i < 0) { /* cell_room left room for one more */
        i = c->pairs.n++;
        c->pairs.slot[i] = (uint16_t)slot;
    }
    c->pairs.code[i] = (uint8_t)code;
}

void
kvf_cell_free(Cell *c, Py_ssize_t *dense_words)
{
    if (cell_dense(c)) {
        *dense_words -= c->dense.words;
        PyMem_Free(c->dense.bits);
    }
    memset(c, 0, sizeof(*c));
}

Py_ssize_t
kvf_cell_drop(Cell *c, Py_ssize_t slot, Py_ssize_t *dense_words)
{
    if (!cell_dense(c)) {
        int i = find_pair(c, slot);
        if (i >= 0) { /* the last pair takes its place */
            int last = --c->pairs.n;
            c->pairs.slot[i] = c->pairs.slot[last], c->pairs.code[i] = c->pairs.code[last];
        }
        return c->pairs.n;
    }
    if (!kvf_cell_get(c, slot)) {
        return c->dense.holders;
    }
    c->dense.bits[slot / SLOTS_PER_WORD] &= ~(CODE_MASK << CODE_BITS * (slot % SLOTS_PER_WORD));
    if (--c->dense.holders > SPARSE_BACK) {
        return c->dense.holders;
    }
    Cell back; /* few hold it now: inline, in slot order */
    memset(&back, 0, sizeof(back));
    for (Holders h = holders_of(c); holders_next(&h);) {
        back.pairs.slot[back.pairs.n] = (uint16_t)h.slot;
        back.pairs.code[back.pairs.n++] = (uint8_t)h.code;
    }
    kvf_cell_free(c, dense_words);
    *c = back;
    return c->pairs.n;
}
