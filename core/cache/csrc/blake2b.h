/* BLAKE2b (RFC 7693), keyed, with digests of 1..64 bytes. Written for the page keys of
 * kvfabric.core.cache.keys; no other BLAKE2 parameters (salt, personalization, tree). */
#ifndef KVF_BLAKE2B_H
#define KVF_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

#define KVF_BLAKE2B_BLOCK   128
#define KVF_BLAKE2B_MAX_OUT 64
#define KVF_BLAKE2B_MAX_KEY 64

typedef struct {
    uint64_t h[8];                  /* chained state */
    uint64_t t[2];                  /* bytes compressed so far (128-bit counter) */
    uint8_t buf[KVF_BLAKE2B_BLOCK]; /* input not yet compressed */
    size_t len;                     /* bytes in buf */
    size_t outlen;
} kvf_blake2b;

/* outlen in 1..64, keylen in 0..64 (callers check: these do not). */
void kvf_blake2b_init(kvf_blake2b *s, size_t outlen, const void *key, size_t keylen);
void kvf_blake2b_update(kvf_blake2b *s, const void *in, size_t n);
/* Compress a full buffer now, as the next non-empty update would. Only for a state that
 * will get more input: page keys copy the keyed state once per page, so the key block is
 * compressed once a request instead of once a page. */
void kvf_blake2b_settle(kvf_blake2b *s);
void kvf_blake2b_final(kvf_blake2b *s, uint8_t *out);

#endif
