/* Packing a request's token ids (keys_pack.c). */
#ifndef KVF_KEYS_PACK_H
#define KVF_KEYS_PACK_H

#include <Python.h>

/* The error type bad input raises: keys.py's KeyError_ once set_error has run. */
extern PyObject *kvf_invalid;

/* tokens as int32 bytes (a new reference), or NULL with an error set. */
PyObject *kvf_pack(PyObject *tokens);

/* Whether tokens pack to exactly `raw` (bytes): 1 or 0, without packing lists and tuples of
 * small ints. 0 as soon as they differ (a length, a token); -1 with packing's error set
 * where a token it reads cannot be packed. */
int kvf_equal(PyObject *tokens, PyObject *raw);

#endif
