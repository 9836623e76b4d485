# cython: language_level=3, boundscheck=False, wraparound=False
"""Spike (Run AL): the same frame encode and decode as frame_c.c, in Cython."""
from libc.string cimport memcpy, memset
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from cpython.bytearray cimport PyByteArray_FromStringAndSize, PyByteArray_AS_STRING
import hashlib

cdef object _blake2b = hashlib.blake2b
DEF PREFIX = 28
DEF MAC_LEN = 16

cdef bytes _mac(const unsigned char[:] key, const unsigned char[:] head, uint64_t size):
    h = _blake2b(head, key=key, digest_size=MAC_LEN)
    h.update(size.to_bytes(8, "little"))
    return h.digest()

def encode(int kind, uint64_t seq, const unsigned char[:] payload, const unsigned char[:] key,
           uint64_t ack, bint busy, bint seal):
    cdef Py_ssize_t head = PREFIX + payload.shape[0]
    cdef Py_ssize_t size = head + MAC_LEN
    out = PyByteArray_FromStringAndSize(NULL, size)
    cdef char *p = PyByteArray_AS_STRING(out)
    cdef uint16_t nbuf = 0
    cdef uint16_t state = 1 if busy else 0
    cdef uint32_t plen = payload.shape[0]
    p[0] = b'U'; p[1] = b'X'; p[2] = 7; p[3] = <char>kind
    memcpy(p + 4, &nbuf, 2); memcpy(p + 6, &state, 2); memcpy(p + 8, &plen, 4)
    memcpy(p + 12, &seq, 8); memcpy(p + 20, &ack, 8)
    if plen:
        memcpy(p + PREFIX, &payload[0], plen)
    cdef bytes m
    if seal:
        m = _mac(key, (<unsigned char[:head]> <unsigned char *> p), size)
        memcpy(p + head, <char *> m, MAC_LEN)
    else:
        memset(p + head, 0, MAC_LEN)
    return out

def decode(frame, const unsigned char[:] key):
    cdef const unsigned char[:] b = frame
    cdef Py_ssize_t n = b.shape[0]
    if n < PREFIX + MAC_LEN or b[0] != 85 or b[1] != 88 or b[2] != 7:
        raise ValueError("bad frame")
    cdef uint32_t plen
    cdef uint64_t seq, ack
    cdef uint16_t state
    memcpy(&state, &b[6], 2); memcpy(&plen, &b[8], 4); memcpy(&seq, &b[12], 8); memcpy(&ack, &b[20], 8)
    cdef Py_ssize_t head = PREFIX + plen
    if head + MAC_LEN > n:
        raise ValueError("truncated")
    cdef bytes want = _mac(key, b[:head], n)
    cdef unsigned diff = 0
    cdef int i
    for i in range(MAC_LEN):
        diff |= (<unsigned char> want[i]) ^ b[n - MAC_LEN + i]
    if diff:
        raise ValueError("MAC mismatch")
    return b[3], seq, memoryview(frame)[PREFIX:head], ack, state != 0
