/* ucxrpc._core: the per-message work in C (docs/architecture.md, "The
 * native core").  One file per concern; this header is what they share. */
#ifndef UCXRPC_CORE_H
#define UCXRPC_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* Keyword-aware argument parsing for METH_FASTCALL | METH_KEYWORDS
 * functions: fills out[0..nnames) from positional arguments and keywords,
 * leaving NULL what was not given.  Returns -1 with TypeError set on an
 * unknown, repeated or missing (the first `required` names) argument. */
int core_parse(const char *func, const char *const *names, Py_ssize_t nnames,
               Py_ssize_t required, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames, PyObject **out);

/* A type's keyword-only constructor arguments: out[0..nnames), every one
 * required.  -1 with TypeError naming `type` and the argument otherwise. */
int core_kwonly(const char *type, const char *const *names, Py_ssize_t nnames, PyObject *args,
                PyObject *kwargs, PyObject **out);

/* getattr(o, name) as a uint64: 0, or -1 with an error set. */
int core_attr_u64(PyObject *o, PyObject *name, uint64_t *out);

/* time.monotonic()'s clock (CLOCK_MONOTONIC), in seconds: the deadlines
 * and the loop's timings compare with what Python code reads. */
double core_monotonic(void);

/* The wire's little-endian fields, and its 64-byte alignment (inline
 * buffers in a frame, messages in a BATCH frame: wire/frame.py's ALIGN),
 * for every file that reads or writes frames. */
#define CORE_ALIGN 64
static inline uint64_t core_align(uint64_t n) {
    return (n + CORE_ALIGN - 1) & ~(uint64_t)(CORE_ALIGN - 1);
}
static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* calls.c */
int core_calls_init(PyObject *module);

/* frame.c */
extern PyMethodDef core_frame_methods[];
int core_frame_init(PyObject *module);
/* FrameError (handed down by frame_bind) with a PyUnicode_FromFormat
 * message: always -1. */
int core_frame_errorf(const char *fmt, ...);
/* A host buffer for core_frame_alone: copied inline, or (`remote`) named
 * by its address for the peer to read (wire/frame.py's REMOTE way). */
typedef struct {
    const void *ptr;
    uint64_t len;
    int remote;
} core_inline;
/* A frame whose payload is `head` then `body` and whose `nbuf` buffers
 * (host memory) all travel inline or by address (`remote`), sealed with `key` (16 bytes; NULL:
 * unsealed, a message for a BATCH frame, `seq` its hint), as bytes:
 * encode()'s frame and checks for such a message (FrameError over a limit
 * of `limits`, a wire.frame.Limits).  Py_None (a new reference)
 * where encode() would not inline them all (over inline_threshold or
 * inline_total, a frame over max_frame_bytes or the peer's `peer_max`,
 * more than max_buffers): the caller then leaves the message to it. */
PyObject *core_frame_alone(long kind, uint64_t seq, const Py_buffer *head,
                           const Py_buffer *body, const Py_buffer *key, PyObject *limits,
                           uint64_t ack, int busy, const core_inline *bufs, Py_ssize_t nbuf,
                           uint64_t peer_max);

/* loop.c */
extern PyMethodDef core_loop_methods[];
int core_loop_init(PyObject *module);

/* decode(raw, key, limits) -> Frame, as wire.frame.decode (FrameError,
 * AuthenticationError as it raises them). */
PyObject *core_frame_decode(PyObject *raw, PyObject *key, PyObject *limits);

/* expect.c */
int core_expect_init(PyObject *module);

/* plain.c */
int core_plain_init(PyObject *module);

/* pool.c */
int core_pool_init(PyObject *module);

/* receive.c */
int core_receive_init(PyObject *module);

/* guard() and unguard(outer) of loop.c, for C callers: whether this
 * thread was already in a section Ctrl-C must not cut in half; leaving
 * the outermost one delivers a Ctrl-C held meanwhile (-1 with it raised). */
int core_guard(void);
int core_unguard(int outer);
/* An error put aside (fetched: stolen here) as the __context__ of the one
 * raised since, as a Python `finally:` that raises leaves it. */
void core_chain_over(PyObject *type, PyObject *value, PyObject *tb);

/* reply.c */
extern PyTypeObject core_ReplyType;
int core_reply_init(PyObject *module);
/* A Reply's flag (1 done, 0 not), or -1 if `o` is no Reply: a drive reads
 * it without a call. */
int core_reply_done(PyObject *o);

/* send.c */
int core_send_init(PyObject *module);

/* timer.c */
extern PyMethodDef core_timer_methods[];
/* Arm the timerfd `fd` to fire once after `seconds` (0 disarms it): 0, or
 * -1 with OSError set. */
int core_timer_arm(int fd, double seconds);

/* ucp.c */
extern PyMethodDef core_ucp_methods[];
int core_ucp_init(PyObject *module);

#endif
