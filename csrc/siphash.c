/* SipHash-2-4-128 as its paper specifies it (section 2, and the 128-bit
 * output of the reference code: 0xee into v1 at the start and into v2
 * before the finalization, 0xdd into v1 before the second half).  Words
 * are read little endian whatever the host. */
#include "siphash.h"

#include <string.h>

static inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

static inline uint64_t load64(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

static inline void store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

#define SIPROUND(s)                                                                  \
    do {                                                                             \
        s->v0 += s->v1; s->v1 = rotl(s->v1, 13); s->v1 ^= s->v0; s->v0 = rotl(s->v0, 32); \
        s->v2 += s->v3; s->v3 = rotl(s->v3, 16); s->v3 ^= s->v2;                     \
        s->v0 += s->v3; s->v3 = rotl(s->v3, 21); s->v3 ^= s->v0;                     \
        s->v2 += s->v1; s->v1 = rotl(s->v1, 17); s->v1 ^= s->v2; s->v2 = rotl(s->v2, 32); \
    } while (0)

/* One message word: two compression rounds. */
static inline void word(siphash_state *s, uint64_t m) {
    s->v3 ^= m;
    SIPROUND(s);
    SIPROUND(s);
    s->v0 ^= m;
}

void siphash_init(siphash_state *s, const uint8_t key[SIPHASH_KEY_LEN]) {
    uint64_t k0 = load64(key), k1 = load64(key + 8);
    s->v0 = 0x736f6d6570736575ULL ^ k0;
    s->v1 = 0x646f72616e646f6dULL ^ k1 ^ 0xee;  /* 0xee: the 128-bit output */
    s->v2 = 0x6c7967656e657261ULL ^ k0;
    s->v3 = 0x7465646279746573ULL ^ k1;
    s->fill = 0;
    s->len = 0;
}

void siphash_update(siphash_state *s, const void *in, size_t n) {
    const uint8_t *p = in;
    s->len += n;
    if (s->fill) {  /* complete the word a previous update began */
        size_t take = 8 - s->fill < n ? 8 - s->fill : n;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
        if (s->fill < 8) return;
        word(s, load64(s->buf));
        s->fill = 0;
    }
    for (; n >= 8; p += 8, n -= 8) word(s, load64(p));
    memcpy(s->buf, p, n);
    s->fill = n;
}

void siphash_final(siphash_state *s, uint8_t out[SIPHASH_OUT_LEN]) {
    /* The last word: the bytes left over, and the length's low byte on top. */
    uint64_t last = (s->len & 0xff) << 56;
    for (size_t i = 0; i < s->fill; i++) last |= (uint64_t)s->buf[i] << (8 * i);
    word(s, last);
    s->v2 ^= 0xee;
    for (int i = 0; i < 4; i++) SIPROUND(s);
    store64(out, s->v0 ^ s->v1 ^ s->v2 ^ s->v3);
    s->v1 ^= 0xdd;
    for (int i = 0; i < 4; i++) SIPROUND(s);
    store64(out + 8, s->v0 ^ s->v1 ^ s->v2 ^ s->v3);
}
