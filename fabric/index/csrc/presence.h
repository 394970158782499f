/* The presence table shared by presence.c (the type, the table, bulk set) and lookup.c
 * (the match rule). See presence.c for what the module exports. */
#ifndef KVF_PRESENCE_H
#define KVF_PRESENCE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define KEY_BYTES 16
#define SLOTS_PER_WORD 16            /* 4-bit nibbles in a uint64 */
#define NIBBLE_LOW 0x1111111111111111ULL     /* bit 0 of every nibble */

/* Keys in insertion order (as a dict keeps them: an update keeps the place, a delete
 * and insert moves to the end); an entry whose bits are all 0 is deleted. `index` maps
 * hash -> entry by linear probing over at least twice the entries' capacity. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t window;          /* the MatchRule's window_pages */
    int has_full;               /* the MatchRule's has_full */
    Py_ssize_t words;           /* uint64 words per key: 16 node slots each */
    uint8_t *keys;              /* cap * KEY_BYTES */
    uint64_t *bits;             /* cap * words */
    Py_ssize_t used, live, cap; /* entries written (deleted ones too), live ones, room */
    int32_t *index;             /* -1: empty, -2: a deleted entry's tombstone, else entry */
    size_t mask;                /* index size - 1 */
    uint64_t *ones;             /* words: bit 0 of every open slot's nibble */
    uint64_t *scratch;          /* lookup's per-page arrays */
    Py_ssize_t scratch_len;
} Presence;

/* The entry's bits for a 16-byte key, or NULL. */
uint64_t *kvf_find(Presence *p, const uint8_t *key);

/* `n` items of `items`, each exactly `bytes` of KEY_BYTES, or a ValueError with `what`. */
int kvf_check_keys(PyObject *const *items, Py_ssize_t n, const char *what);

PyObject *kvf_lookup(Presence *p, PyObject *keys);

#endif
