/* BLAKE2b (RFC 7693), keyed, for the frame MAC: the same digests as
 * Python's hashlib.blake2b(data, key=key, digest_size=n).  Written here
 * rather than called through hashlib because a call through the CPython API
 * (object, update, digest) cost ~1 µs per MAC, more than the hashing of a
 * small frame (Run AL). */
#ifndef UCXRPC_BLAKE2B_H
#define UCXRPC_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

#define BLAKE2B_BLOCK 128
#define BLAKE2B_MAX_KEY 64
#define BLAKE2B_MAX_OUT 64

typedef struct {
    uint64_t h[8];
    uint64_t t[2];           /* bytes hashed so far, 128-bit counter */
    uint8_t buf[BLAKE2B_BLOCK];
    size_t fill;             /* bytes waiting in buf */
    size_t outlen;
} blake2b_state;

/* outlen 1..64, keylen 0..64 (0: unkeyed); returns -1 on bad lengths. */
int blake2b_init(blake2b_state *s, size_t outlen, const void *key, size_t keylen);
void blake2b_update(blake2b_state *s, const void *in, size_t n);
void blake2b_final(blake2b_state *s, void *out);

#endif
