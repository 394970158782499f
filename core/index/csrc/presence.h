/* The index core's C types, shared by its sources:
 *   ordered.c           an ordered set of 16-byte keys (insertion order, as a dict keeps it)
 *   presence.c          the Presence type: the module, argument checks and the methods
 *   presence_records.c  a chain's apply, a slot's clear, its pages and the keys' last records
 *   presence_holders.c  a key's holders: inline (slot, code) pairs while few, else a bitset
 *   lookups.c           the match rule over the keys' codes (core/index/lookups.py's)
 * See presence.c for what the module exports. */
#ifndef KVF_PRESENCE_H
#define KVF_PRESENCE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define KEY_BYTES      16
#define CODE_BITS      8 /* a slot's code (presence.py's `code`) in a packed word */
#define CODE_MASK      0xFFULL
#define CODE_ONES      0x0101010101010101ULL /* bit 0 of every code of a word */
#define SLOTS_PER_WORD (64 / CODE_BITS)
/* A code's bits: FULL on any tier (bit 0), FULL on device, SWA on any, SWA on device, FULL
 * in memory (device or host), SWA in memory: these shifts bring one to bit 0. */
#define CODE_F_DEV  1
#define CODE_S_ANY  2
#define CODE_S_DEV  3
#define CODE_F_MEM  4
#define CODE_S_MEM  5
#define MAX_SLOTS   (1 << 16) /* presence.py's MAX_SLOTS */
#define MAX_MASK    63        /* PageMask.FULL | PageMask.SWA */
#define SPARSE_MAX  5         /* holders a key keeps inline (presence.py's) */
#define SPARSE_BACK 3         /* a dense key this few hold goes back inline */
#define DENSE       0xFF      /* Cell.pairs.n of a dense cell */

/* Keys in insertion order (an update keeps the place, a delete and insert moves to the
 * end). `index` maps hash -> entry by linear probing over at least twice the capacity;
 * deleted entries stay (dead[e] = 1) until a reserve compacts them away. */
typedef struct {
    uint8_t *keys;              /* cap * KEY_BYTES */
    uint8_t *dead;              /* cap: 1 for a deleted entry */
    int32_t *index;             /* -1: empty, -2: a deleted entry's tombstone, else entry */
    size_t mask;                /* index size - 1 */
    Py_ssize_t used, live, cap; /* entries written (deleted ones too), live ones, room */
} Ordered;

/* An array kept beside an Ordered's entries, `size` bytes an entry: moved along when a
 * reserve compacts or grows the entries. */
typedef struct {
    void **data;
    size_t size;
} Column;

/* Inline: a lookup or a chain's apply finds each of its keys, several times for some. */
static inline uint64_t
ord_hash(const uint8_t *key)
{
    uint64_t a, b;
    memcpy(&a, key, 8);
    memcpy(&b, key + 8, 8);
    uint64_t h = a ^ (b * 0x9E3779B97F4A7C15ULL); /* keys may be chosen, not only hashed */
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h ^ (h >> 29);
}

/* The entry of `key`, or -1; *pos: its index position, else where it would go. */
static inline Py_ssize_t
ord_find(const Ordered *o, const uint8_t *key, size_t *pos)
{
    if (o->index == NULL) {
        return -1; /* nothing ever added; ord_add needs a reserve first */
    }
    size_t i = ord_hash(key) & o->mask, tomb = SIZE_MAX;
    for (;; i = (i + 1) & o->mask) {
        int32_t e = o->index[i];
        if (e == -1) {
            *pos = tomb != SIZE_MAX ? tomb : i;
            return -1;
        }
        if (e == -2) {
            if (tomb == SIZE_MAX) {
                tomb = i;
            }
        }
        else if (memcmp(o->keys + (size_t)e * KEY_BYTES, key, KEY_BYTES) == 0) {
            *pos = i;
            return e;
        }
    }
}

/* Warms the cache for a coming ord_find of `key` (its index position). */
static inline void
ord_prefetch(const Ordered *o, const uint8_t *key)
{
    if (o->index != NULL) {
        __builtin_prefetch(o->index + (ord_hash(key) & o->mask));
    }
}
/* Room for `extra` more entries (each column too); nothing changes if memory runs out. */
int kvf_ord_reserve(Ordered *o, Py_ssize_t extra, const Column *cols, int ncols);
/* A new entry for `key` at index position `pos` (from ord_find; room reserved). */
Py_ssize_t kvf_ord_add(Ordered *o, size_t pos, const uint8_t *key);
/* The entry at index position `pos` is deleted. */
void kvf_ord_remove(Ordered *o, size_t pos);
void kvf_ord_free(Ordered *o, const Column *cols, int ncols);

/* What one slot holds: per key, the mask it last published; the parent and depth are the
 * key's record in Presence.held, or the slot's own where that changed since (presence_records.c).
 */
typedef struct {
    int open;
    Ordered set;
    uint8_t *masks;   /* set.cap: the mask, and OWN if the record is in `own` */
    Ordered own;      /* keys whose record differs from the key's last one */
    uint8_t *parents; /* own.cap * KEY_BYTES */
    uint64_t *depths; /* own.cap */
} Pages;

/* Which slots hold a key and how, 16 bytes whoever they are: while at most SPARSE_MAX
 * do, their (slot, code) pairs inline, in no order; past that, a bitset of codes on
 * the heap, as wide as its highest holder needs (words beyond it are zeros). A dense
 * key goes back inline when SPARSE_BACK hold it, not SPARSE_MAX: a key that a slot joins
 * and leaves at the boundary does not allocate each time. The tag byte (pairs.n, or
 * DENSE) is the last in both forms. */
typedef union {
    struct {
        uint16_t slot[SPARSE_MAX];
        uint8_t code[SPARSE_MAX];
        uint8_t n;
    } pairs;
    struct {
        uint64_t *bits;
        uint32_t holders;
        uint16_t words;
        uint8_t unused, tag;
    } dense;
} Cell;

/* Each holder of a cell in turn: `slot` and `code` after every holders_next that is 1. */
typedef struct {
    const Cell *c;
    Py_ssize_t i, slot;
    uint64_t x;
    int code;
} Holders;

static inline int
cell_dense(const Cell *c)
{
    return c->pairs.n == DENSE;
}

static inline Py_ssize_t
cell_count(const Cell *c)
{
    return cell_dense(c) ? (Py_ssize_t)c->dense.holders : c->pairs.n;
}

static inline Holders
holders_of(const Cell *c)
{
    Holders h = {c, -1, 0, 0, 0};
    return h;
}

static inline int
holders_next(Holders *h)
{
    const Cell *c = h->c;
    if (!cell_dense(c)) {
        if (++h->i >= c->pairs.n) {
            return 0;
        }
        h->slot = c->pairs.slot[h->i], h->code = c->pairs.code[h->i];
        return 1;
    }
    while (!h->x) {
        if (++h->i >= c->dense.words) {
            return 0;
        }
        h->x = c->dense.bits[h->i];
    }
    int b = __builtin_ctzll(h->x) & ~(CODE_BITS - 1);
    h->slot = h->i * SLOTS_PER_WORD + b / CODE_BITS, h->code = (int)(h->x >> b & CODE_MASK);
    h->x &= ~(CODE_MASK << b);
    return 1;
}

/* presence_holders.c: the slot's code (0: not a holder). */
int kvf_cell_get(const Cell *c, Py_ssize_t slot);
/* Room to give `slot` a code without allocating (dense, or wider, if need be); -1 with
 * MemoryError, the cell's holders unchanged. */
int kvf_cell_room(Cell *c, Py_ssize_t slot, Py_ssize_t *dense_words);
/* The slot's code is `code` (nonzero): room made by cell_room first. */
void kvf_cell_set(Cell *c, Py_ssize_t slot, int code);
/* The slot holds the key no more; the holders left. Never allocates. */
Py_ssize_t kvf_cell_drop(Cell *c, Py_ssize_t slot, Py_ssize_t *dense_words);
/* The heap bits of a dense cell back (the cell is empty after). */
void kvf_cell_free(Cell *c, Py_ssize_t *dense_words);

/* Where a chain's apply found a key in Presence.held: its entry (-1: none), and its
 * index position (where it would go, if none). */
typedef struct {
    Py_ssize_t entry;
    size_t pos;
} Place;

typedef struct {
    PyObject_HEAD Py_ssize_t window; /* the MatchRule's window_pages */
    int has_full;                    /* the MatchRule's has_full */
    Py_ssize_t words;                /* uint64 words of `ones`: SLOTS_PER_WORD node slots each */
    Ordered held;                    /* keys some slot holds */
    Cell *cells;                     /* held.cap: the key's holders */
    Py_ssize_t dense_words;          /* words the dense cells hold on the heap */
    uint8_t *parents; /* held.cap * KEY_BYTES: the key's last publication's parent */
    uint64_t *depths; /* held.cap: and its depth */
    uint64_t *ones;   /* words: bit 0 of every open slot's code */
    Pages *slots;     /* nslots */
    Py_ssize_t nslots;
    int32_t *local;    /* nslots: -1, or a slot's place among a lookup's candidates */
    uint64_t *scratch; /* lookup's per-page arrays */
    Py_ssize_t scratch_len;
    const Cell **found; /* lookup's cell per page */
    Py_ssize_t found_len;
    int32_t *order; /* lookup's candidate slots */
    Py_ssize_t order_len;
    Place *places; /* a chain's apply: each key's place in `held` */
    Py_ssize_t places_len;
} Presence;

/* The entry's cell for a 16-byte key, or NULL. */
Cell *kvf_find(Presence *p, const uint8_t *key);

/* `n` items of `items`, each exactly `bytes` of KEY_BYTES, or a ValueError with `what`. */
int kvf_check_keys(PyObject *const *items, Py_ssize_t n, const char *what);

/* presence_records.c */
int kvf_set_chain(Presence *p, Pages *s, Py_ssize_t slot, PyObject *const *keys, Py_ssize_t n,
                  uint64_t first_depth, const uint8_t *parent, int mask);
void kvf_clear(Presence *p, Pages *s, Py_ssize_t slot);
PyObject *kvf_pages(Presence *p, Pages *s);
PyObject *kvf_meta(Presence *p, const uint8_t *key);
void kvf_free_pages(Pages *s);
void kvf_free_held(Presence *p);

PyObject *kvf_lookup(Presence *p, PyObject *keys);

#endif
