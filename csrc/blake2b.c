/* BLAKE2b as RFC 7693 specifies it (sections 2 and 3); the tests compare
 * it with hashlib's for every length and key size that matters. */
#include "blake2b.h"

#include <string.h>

static const uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
    0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
    0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

static const uint8_t SIGMA[12][16] = {
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
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    /* Little endian whatever the host's order (the RFC's words are). */
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = rotr(v[d] ^ v[a], 32);  \
        v[c] = v[c] + v[d];            \
        v[b] = rotr(v[b] ^ v[c], 24);  \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = rotr(v[d] ^ v[a], 16);  \
        v[c] = v[c] + v[d];            \
        v[b] = rotr(v[b] ^ v[c], 63);  \
    } while (0)

static void compress(blake2b_state *s, const uint8_t *block, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = SIGMA[r];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void count(blake2b_state *s, size_t n) {
    s->t[0] += n;
    if (s->t[0] < n) s->t[1]++;
}

int blake2b_init(blake2b_state *s, size_t outlen, const void *key, size_t keylen) {
    if (outlen == 0 || outlen > BLAKE2B_MAX_OUT || keylen > BLAKE2B_MAX_KEY) return -1;
    memcpy(s->h, IV, sizeof IV);
    /* Parameter block's first word: digest length, key length, fanout 1,
     * depth 1 (sequential mode); the rest of the block is zero. */
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    s->t[0] = s->t[1] = 0;
    s->fill = 0;
    s->outlen = outlen;
    if (keylen) {
        /* The key, zero-padded, is the first block. */
        memset(s->buf, 0, BLAKE2B_BLOCK);
        memcpy(s->buf, key, keylen);
        s->fill = BLAKE2B_BLOCK;
    }
    return 0;
}

void blake2b_update(blake2b_state *s, const void *in, size_t n) {
    const uint8_t *p = in;
    while (n) {
        /* A full buffer is compressed only once more input follows: the
         * last block must be compressed with the final flag. */
        if (s->fill == BLAKE2B_BLOCK) {
            count(s, BLAKE2B_BLOCK);
            compress(s, s->buf, 0);
            s->fill = 0;
        }
        if (s->fill == 0) {
            while (n > BLAKE2B_BLOCK) {  /* whole blocks straight from the input */
                count(s, BLAKE2B_BLOCK);
                compress(s, p, 0);
                p += BLAKE2B_BLOCK;
                n -= BLAKE2B_BLOCK;
            }
        }
        size_t take = BLAKE2B_BLOCK - s->fill;
        if (take > n) take = n;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
    }
}

void blake2b_final(blake2b_state *s, void *out) {
    count(s, s->fill);
    memset(s->buf + s->fill, 0, BLAKE2B_BLOCK - s->fill);
    compress(s, s->buf, 1);
    uint8_t full[64];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) full[8 * i + j] = (uint8_t)(s->h[i] >> (8 * j));
    memcpy(out, full, s->outlen);
}
