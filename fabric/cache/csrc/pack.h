/* Packing a request's token ids (pack.c). */
#ifndef KVF_PACK_H
#define KVF_PACK_H

#include <Python.h>

/* The error type bad input raises: keys.py's KeyError_ once set_error has run. */
extern PyObject *kvf_invalid;

/* tokens as int32 bytes (a new reference), or NULL with an error set. */
PyObject *kvf_pack(PyObject *tokens);

#endif
