/* BLAKE2b as RFC 7693 specifies it: 12 rounds of the G mixing function over a 16-word
 * work vector, 64-bit little-endian words, the SHA-512 initial values. */
#include "blake2b.h"

#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* The message word schedule of each round; rounds 10 and 11 reuse rows 0 and 1. */
static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t
rotr(uint64_t x, unsigned n)
{
    return (x >> n) | (x << (64 - n));
}

static inline uint64_t
load64(const uint8_t *p)
{
    /* Byte by byte, so the result does not depend on the host's byte order. */
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

#define G(a, b, c, d, x, y)                                                                       \
    do {                                                                                          \
        v[a] = v[a] + v[b] + (x);                                                                 \
        v[d] = rotr(v[d] ^ v[a], 32);                                                             \
        v[c] = v[c] + v[d];                                                                       \
        v[b] = rotr(v[b] ^ v[c], 24);                                                             \
        v[a] = v[a] + v[b] + (y);                                                                 \
        v[d] = rotr(v[d] ^ v[a], 16);                                                             \
        v[c] = v[c] + v[d];                                                                       \
        v[b] = rotr(v[b] ^ v[c], 63);                                                             \
    } while (0)

#define ROUND(r)                                                                                  \
    do {                                                                                          \
        const uint8_t *z = SIGMA[r];                                                              \
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);                                                         \
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);                                                         \
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);                                                        \
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);                                                        \
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);                                                        \
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);                                                      \
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);                                                       \
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);                                                       \
    } while (0)

static void
compress(kvf_blake2b *s, const uint8_t *block, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) {
        m[i] = load64(block + 8 * i);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) {
        v[14] = ~v[14];
    }
    /* Rounds spelled out: with a constant round number every message index is a
     * constant, and the words stay in registers (a page key took 1.5x as long with a loop). */
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(0);
    ROUND(1);
    for (int i = 0; i < 8; i++) {
        s->h[i] ^= v[i] ^ v[i + 8];
    }
}

static void
count(kvf_blake2b *s, size_t n)
{
    s->t[0] += n;
    if (s->t[0] < n) {
        s->t[1]++;
    }
}

void
kvf_blake2b_init(kvf_blake2b *s, size_t outlen, const void *key, size_t keylen)
{
    memcpy(s->h, IV, sizeof IV);
    /* Parameter block word 0: digest length, key length, fanout 1, depth 1. */
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    s->t[0] = s->t[1] = 0;
    s->len = 0;
    s->outlen = outlen;
    if (keylen > 0) {
        /* The key, zero padded, is the first block of the message. */
        memset(s->buf, 0, sizeof s->buf);
        memcpy(s->buf, key, keylen);
        s->len = KVF_BLAKE2B_BLOCK;
    }
}

void
kvf_blake2b_settle(kvf_blake2b *s)
{
    if (s->len == KVF_BLAKE2B_BLOCK) {
        count(s, KVF_BLAKE2B_BLOCK);
        compress(s, s->buf, 0);
        s->len = 0;
    }
}

void
kvf_blake2b_update(kvf_blake2b *s, const void *in, size_t n)
{
    const uint8_t *p = in;
    while (n > 0) {
        /* A full buffer is compressed only once more input arrives: the last block of
         * the message is compressed by final, with the last-block flag. */
        kvf_blake2b_settle(s);
        size_t take = KVF_BLAKE2B_BLOCK - s->len;
        if (take > n) {
            take = n;
        }
        memcpy(s->buf + s->len, p, take);
        s->len += take;
        p += take;
        n -= take;
    }
}

void
kvf_blake2b_final(kvf_blake2b *s, uint8_t *out)
{
    count(s, s->len);
    memset(s->buf + s->len, 0, KVF_BLAKE2B_BLOCK - s->len);
    compress(s, s->buf, 1);
    uint8_t full[KVF_BLAKE2B_MAX_OUT];
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < 8; j++) {
            full[8 * i + j] = (uint8_t)(s->h[i] >> (8 * j));
        }
    }
    memcpy(out, full, s->outlen);
}
