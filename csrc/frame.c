/* The transport's frame in C: encode, decode and the MAC.  The layout, the
 * flags and what each check guards are described once, in
 * ucxrpc/transport/wire/frame.py's docstring, which owns the constants;
 * this file is their only implementation.
 *
 * The Python types a decoded frame is made of (Frame, BufferDesc, the
 * FrameKind members, FrameError) are defined up there and handed down once
 * by frame_bind(), so this layer never imports the ones above it. */
#include "core.h"

#include <stdint.h>
#include <string.h>

#include "siphash.h"

/* Sums of buffer sizes (up to 65535 of under 2**64 each) never wrap in it. */
typedef unsigned __int128 u128;
#define U128_MAX (~(u128)0)

#define PREFIX_LEN 28
#define DESC_LEN 24
#define MAC_LEN 16
#define ALIGN CORE_ALIGN
#define MAGIC0 'U'
#define MAGIC1 'X'
#define VERSION 8
#define NOT_INLINE UINT64_MAX
#define STAGED 1
#define PACK 2
#define PACKED 4
#define REMOTE 8
#define WRITTEN 16
#define BUSY 1
#define KIND_BATCH 6
#define MIN_CHUNK_KIB 64
#define NKINDS 16
/* Hashing more than this releases the GIL, as hashlib does (2 KiB there):
 * a large pickled payload takes long enough to stall the caller's other
 * threads.  32 KiB is ~12 µs of SipHash on the project's VM, what 8 KiB
 * of the BLAKE2b before it took; below it, handing the GIL over and
 * taking it back would cost more than the hashing. */
#define NOGIL_MAC_BYTES 32768

/* Handed down by frame_bind(). */
static PyTypeObject *frame_type, *desc_type;
static PyObject *kinds[NKINDS];  /* FrameKind members by number, NULL if none */
static PyObject *frame_error;    /* ucxrpc.errors.FrameError */
static PyObject *np_empty, *np_uint8;

/* The last Limits seen, and its fields: a frozen dataclass, so its fields
 * are read once per object rather than five attribute lookups per frame. */
static PyObject *limits_seen;
static struct {
    u128 max_buffers, max_frame_bytes, max_message_bytes, inline_threshold,
        inline_total;
} lim;

int core_frame_errorf(const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (msg) {
        PyErr_SetObject(frame_error ? frame_error : PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return -1;
}

static int read_u64(PyObject *o, const char *what, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "%s must be an int in [0, 2**64)", what);
        }
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *u128_long(u128 v) {
    if (!(v >> 64)) return PyLong_FromUnsignedLongLong((unsigned long long)v);
    PyObject *hi = PyLong_FromUnsignedLongLong((unsigned long long)(v >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)v);
    PyObject *sh = PyLong_FromLong(64), *r = NULL;
    if (hi && lo && sh) {
        PyObject *up = PyNumber_Lshift(hi, sh);
        if (up) {
            r = PyNumber_Or(up, lo);
            Py_DECREF(up);
        }
    }
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(sh);
    return r;
}

/* A limit as a 128-bit number, saturating: no sum a frame can make (at
 * most 65535 buffers of under 2**64 bytes) comes near 2**128, so a larger
 * limit is exactly as good as none. */
static int read_limit(PyObject *o, const char *what, u128 *out) {
    if (!PyLong_Check(o) || _PyLong_Sign(o) < 0) {
        PyErr_Format(PyExc_ValueError, "Limits.%s must be a non-negative int", what);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (!(v == (unsigned long long)-1 && PyErr_Occurred())) {
        *out = v;
        return 0;
    }
    PyErr_Clear();
    if (_PyLong_NumBits(o) > 128) {
        *out = U128_MAX;
        return 0;
    }
    unsigned char bytes[16];
    if (_PyLong_AsByteArray((PyLongObject *)o, bytes, 16, 1, 0) < 0) return -1;
    u128 r = 0;
    for (int i = 15; i >= 0; i--) r = r << 8 | bytes[i];
    *out = r;
    return 0;
}

static int read_limits(PyObject *limits) {
    if (limits == limits_seen) return 0;
    static const char *const names[5] = {"max_buffers", "max_frame_bytes", "max_message_bytes",
                                         "inline_threshold", "inline_total"};
    u128 v[5];
    for (int i = 0; i < 5; i++) {
        PyObject *o = PyObject_GetAttrString(limits, names[i]);
        if (!o) return -1;
        int rc = read_limit(o, names[i], &v[i]);
        Py_DECREF(o);
        if (rc < 0) return -1;
    }
    lim.max_buffers = v[0];
    lim.max_frame_bytes = v[1];
    lim.max_message_bytes = v[2];
    lim.inline_threshold = v[3];
    lim.inline_total = v[4];
    Py_INCREF(limits);
    Py_XSETREF(limits_seen, limits);
    return 0;
}

/* The MAC: SipHash-2-4-128 (siphash.h says why) keyed with the pipe
 * direction's 16-byte key, over the head (prefix, descriptors, payload)
 * and the frame's total length, little endian.  mac_run computes it;
 * mac_into checks the key and releases the GIL for a long head. */
static void mac_run(const uint8_t *key, const uint8_t *head, size_t n, uint64_t size,
                    uint8_t *out) {
    siphash_state s;
    siphash_init(&s, key);
    uint8_t sz[8];
    put64(sz, size);
    siphash_update(&s, head, n);
    siphash_update(&s, sz, 8);
    siphash_final(&s, out);
}

static int mac_into(const Py_buffer *key, const uint8_t *head, size_t n, uint64_t size,
                    uint8_t *out) {
    if (key->len != SIPHASH_KEY_LEN) {
        PyErr_Format(PyExc_ValueError, "MAC key of %zd bytes; the frame MAC (SipHash-2-4) "
                     "takes %d", key->len, SIPHASH_KEY_LEN);
        return -1;
    }
    if (n >= NOGIL_MAC_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        mac_run(key->buf, head, n, size, out);
        Py_END_ALLOW_THREADS
    } else {
        mac_run(key->buf, head, n, size, out);
    }
    return 0;
}

/* mac(key, head, size) -> 16 bytes */
static PyObject *frame_mac(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "mac() takes 3 arguments (key, head, size)");
        return NULL;
    }
    uint64_t size;
    if (read_u64(args[2], "size", &size) < 0) return NULL;
    Py_buffer key, head;
    if (PyObject_GetBuffer(args[0], &key, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &head, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    uint8_t out[MAC_LEN];
    int rc = mac_into(&key, head.buf, (size_t)head.len, size, out);
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    return rc < 0 ? NULL : PyBytes_FromStringAndSize((const char *)out, MAC_LEN);
}

/* FrameError "<what> of <n> bytes exceeds <name>=<limit>", the numbers exact. */
static void over_limit(const char *what, u128 n, const char *name, u128 limit) {
    PyObject *a = u128_long(n), *b = a ? u128_long(limit) : NULL;
    if (b) core_frame_errorf("%s of %S bytes exceeds %s=%S", what, a, name, b);
    Py_XDECREF(a);
    Py_XDECREF(b);
}

static inline u128 align_up128(u128 n) { return (n + ALIGN - 1) & ~(u128)(ALIGN - 1); }

/* A frame's prefix (wire/frame.py's layout). */
static void put_prefix(uint8_t *p, long kind, Py_ssize_t nbuf, int busy, uint32_t payload_len,
                       uint64_t seq, uint64_t ack) {
    p[0] = MAGIC0;
    p[1] = MAGIC1;
    p[2] = VERSION;
    p[3] = (uint8_t)kind;
    put16(p + 4, (uint16_t)nbuf);
    put16(p + 6, busy ? BUSY : 0);
    put32(p + 8, payload_len);
    put64(p + 12, seq);
    put64(p + 20, ack);
}

/* One buffer of a message being encoded. */
typedef struct {
    uint64_t nbytes, where, arg;
    int64_t device;
    uint8_t flags;
    uint8_t inline_;
} slot;

/* An item of a sequence of tuples: (a, b, c) read as borrowed references. */
static int triple(PyObject *item, const char *what, Py_ssize_t i, PyObject **a, PyObject **b,
                  PyObject **c) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_Format(PyExc_TypeError, "%s %zd must be a 3-tuple, not %R", what, i, item);
        return -1;
    }
    *a = PyTuple_GET_ITEM(item, 0);
    *b = PyTuple_GET_ITEM(item, 1);
    *c = PyTuple_GET_ITEM(item, 2);
    return 0;
}

/* Buffer `i` goes as a message of its own: its index joins `separate`. */
static int append_index(PyObject *separate, Py_ssize_t i) {
    PyObject *ix = PyLong_FromSsize_t(i);
    int rc = ix ? PyList_Append(separate, ix) : -1;
    Py_XDECREF(ix);
    return rc;
}

static const char *const encode_names[] = {"kind", "seq", "payload", "buffers", "key", "limits",
                                           "ways", "peer_max_frame", "seal", "ack", "busy"};

/* encode(kind, seq, payload, buffers, key, limits, ways=None,
 *        peer_max_frame=1<<62, seal=True, ack=0, busy=False)
 *   -> (frame as a uint8 numpy array, [indices of buffers sent separately])
 * as documented on ucxrpc.transport.wire.frame.encode. */
static PyObject *frame_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    PyObject *a[11];
    if (core_parse("encode", encode_names, 11, 6, args, nargs, kwnames, a) < 0) return NULL;
    PyObject *buffers = a[3], *ways = a[6] == Py_None ? NULL : a[6];
    long kind = PyLong_AsLong(a[0]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (kind < 0 || kind > 255) {
        PyErr_Format(PyExc_ValueError, "frame kind %ld out of range", kind);
        return NULL;
    }
    uint64_t seq, ack = 0, peer_max = (uint64_t)1 << 62;
    if (read_u64(a[1], "seq", &seq) < 0) return NULL;
    if (a[7] && read_u64(a[7], "peer_max_frame", &peer_max) < 0) return NULL;
    if (a[9] && read_u64(a[9], "ack", &ack) < 0) return NULL;
    int seal = a[8] ? PyObject_IsTrue(a[8]) : 1;
    int busy = a[10] ? PyObject_IsTrue(a[10]) : 0;
    if (seal < 0 || busy < 0) return NULL;
    if (read_limits(a[5]) < 0) return NULL;
    if (!PyTuple_Check(buffers) && !PyList_Check(buffers)) {
        PyErr_Format(PyExc_TypeError, "buffers must be a list or tuple, not %.100s",
                     Py_TYPE(buffers)->tp_name);
        return NULL;
    }
    Py_ssize_t nbuf = PySequence_Fast_GET_SIZE(buffers);
    if ((u128)nbuf > lim.max_buffers) {
        PyObject *m = u128_long(lim.max_buffers);
        if (m) {
            core_frame_errorf("message has %zd buffers; the limit is %S", nbuf, m);
            Py_DECREF(m);
        }
        return NULL;
    }
    if (nbuf > 0xFFFF) {
        core_frame_errorf("message has %zd buffers; a frame can describe 65535", nbuf);
        return NULL;
    }
    if (ways && (!(PyTuple_Check(ways) || PyList_Check(ways)) ||
                 PySequence_Fast_GET_SIZE(ways) != nbuf)) {
        PyErr_SetString(PyExc_TypeError, "ways must be a list or tuple, one per buffer");
        return NULL;
    }

    Py_buffer payload, key = {0};
    if (PyObject_GetBuffer(a[2], &payload, PyBUF_SIMPLE) < 0) return NULL;
    if (seal && PyObject_GetBuffer(a[4], &key, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    PyObject *result = NULL, *arr = NULL, *separate = NULL;
    slot few[8], *slots = nbuf <= 8 ? few : PyMem_Malloc(sizeof(slot) * (size_t)nbuf);
    if (!slots) {
        PyErr_NoMemory();
        goto done;
    }
    separate = PyList_New(0);
    if (!separate) goto done;
    if (payload.len > UINT32_MAX) {
        core_frame_errorf("payload of %zd bytes; a frame carries at most 4 GiB", payload.len);
        goto done;
    }

    uint64_t head_len = PREFIX_LEN + (uint64_t)DESC_LEN * (uint64_t)nbuf + (uint64_t)payload.len;
    u128 start = core_align(head_len), cursor = start, total = 0;
    int any_inline = 0;
    u128 cap = lim.max_frame_bytes < peer_max ? lim.max_frame_bytes : peer_max;
    u128 frame_cap = cap > MAC_LEN ? cap - MAC_LEN : 0;
    u128 budget = start + lim.inline_total;  /* both under 2**127: no wrap */
    if (budget > frame_cap) budget = frame_cap;
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        PyObject *n_o, *view, *dev_o;
        if (triple(PySequence_Fast_GET_ITEM(buffers, i), "buffer", i, &n_o, &view, &dev_o) < 0)
            goto done;
        slot *s = &slots[i];
        if (read_u64(n_o, "a buffer's nbytes", &s->nbytes) < 0) goto done;
        long long dev = PyLong_AsLongLong(dev_o);
        if (dev == -1 && PyErr_Occurred()) goto done;
        if (dev < -1 || dev > INT16_MAX) {
            PyErr_Format(PyExc_ValueError, "buffer %zd: device %lld out of range", i, dev);
            goto done;
        }
        s->device = dev;
        s->flags = 0;
        s->arg = 0;
        s->inline_ = 0;
        if (ways) {
            PyObject *f_o, *arg_o, *where_o;
            if (triple(PySequence_Fast_GET_ITEM(ways, i), "way", i, &f_o, &arg_o, &where_o) < 0)
                goto done;
            uint64_t flags;
            if (read_u64(f_o, "a way's flags", &flags) < 0 ||
                read_u64(arg_o, "a way's arg", &s->arg) < 0)
                goto done;
            if (flags > 0xFF || s->arg > UINT32_MAX) {
                PyErr_Format(PyExc_ValueError, "buffer %zd: flags %llu or arg %llu out of range",
                             i, (unsigned long long)flags, (unsigned long long)s->arg);
                goto done;
            }
            s->flags = (uint8_t)flags;
            if (flags) {
                if (flags == PACKED || flags == REMOTE || flags == WRITTEN) {
                    if (read_u64(where_o, "a way's where", &s->where) < 0) goto done;
                    if (flags != PACKED) total += s->nbytes;
                } else {
                    total += s->nbytes;
                    s->where = NOT_INLINE;
                    if (append_index(separate, i) < 0) goto done;
                }
                continue;
            }
        }
        total += s->nbytes;
        u128 end = align_up128(cursor + s->nbytes);
        if (view != Py_None && s->device < 0 && s->nbytes <= lim.inline_threshold &&
            end <= budget) {
            s->where = (uint64_t)cursor;  /* under budget, itself under 2**64 */
            s->inline_ = 1;
            any_inline = 1;
            cursor = end;
        } else {
            s->where = NOT_INLINE;
            if (append_index(separate, i) < 0) goto done;
        }
    }
    u128 size = (any_inline ? cursor : head_len) + MAC_LEN;
    if (size > lim.max_frame_bytes) {
        over_limit("frame", size, "max_frame_bytes", lim.max_frame_bytes);
        goto done;
    }
    /* A BATCH frame is not a message but holds several, each checked when
     * it was queued (send.py) and again by the receiver (receive.py): the
     * limit is theirs.  Applied to the batch, a callee with a small limit
     * refused its own batch of replies, and the replies in it were lost. */
    if (kind != KIND_BATCH && size + total > lim.max_message_bytes) {
        over_limit("message", size + total, "max_message_bytes", lim.max_message_bytes);
        goto done;
    }
    if (size >> 62) {  /* only a limit of "none" lets it get here; no memory holds it */
        PyErr_NoMemory();
        goto done;
    }

    /* ucxx's Array is unsafe with a bytearray (it may be resized under a
     * send in flight): the frame is a numpy array. */
    PyObject *size_o = PyLong_FromUnsignedLongLong((uint64_t)size);
    if (!size_o) goto done;
    PyObject *empty_args[2] = {size_o, np_uint8};
    arr = PyObject_Vectorcall(np_empty, empty_args, 2, NULL);
    Py_DECREF(size_o);
    if (!arr) goto done;
    Py_buffer out;
    if (PyObject_GetBuffer(arr, &out, PyBUF_WRITABLE) < 0) goto done;
    uint8_t *p = out.buf;
    put_prefix(p, kind, nbuf, busy, (uint32_t)payload.len, seq, ack);
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        uint8_t *d = p + PREFIX_LEN + DESC_LEN * i;
        put64(d, slots[i].nbytes);
        put64(d + 8, slots[i].where);
        put16(d + 16, (uint16_t)(int16_t)slots[i].device);
        d[18] = slots[i].flags;
        d[19] = 0;
        put32(d + 20, (uint32_t)slots[i].arg);
    }
    uint64_t pos = head_len - (uint64_t)payload.len;
    memcpy(p + pos, payload.buf, (size_t)payload.len);
    if (any_inline) {
        /* The gaps that align inline buffers are zeroed: a frame carries
         * no stale heap bytes to its peer. */
        memset(p + head_len, 0, (size_t)((uint64_t)cursor - head_len));
        for (Py_ssize_t i = 0; i < nbuf; i++) {
            if (!slots[i].inline_) continue;
            PyObject *view = PyTuple_GET_ITEM(PySequence_Fast_GET_ITEM(buffers, i), 1);
            Py_buffer vb;
            if (PyObject_GetBuffer(view, &vb, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&out);
                goto done;
            }
            if ((uint64_t)vb.len != slots[i].nbytes) {
                PyErr_Format(PyExc_ValueError, "buffer %zd: its view holds %zd bytes, its "
                             "descriptor says %llu", i, vb.len,
                             (unsigned long long)slots[i].nbytes);
                PyBuffer_Release(&vb);
                PyBuffer_Release(&out);
                goto done;
            }
            memcpy(p + slots[i].where, vb.buf, (size_t)vb.len);
            PyBuffer_Release(&vb);
        }
    }
    int rc = 0;
    if (seal)
        rc = mac_into(&key, p, (size_t)head_len, (uint64_t)size, p + size - MAC_LEN);
    else
        memset(p + size - MAC_LEN, 0, MAC_LEN);
    PyBuffer_Release(&out);
    if (rc < 0) goto done;
    result = PyTuple_Pack(2, arr, separate);
done:
    if (slots && slots != few) PyMem_Free(slots);
    Py_XDECREF(arr);
    Py_XDECREF(separate);
    PyBuffer_Release(&payload);
    if (key.obj) PyBuffer_Release(&key);
    return result;
}

PyObject *core_frame_alone(long kind, uint64_t seq, const Py_buffer *head,
                           const Py_buffer *body, const Py_buffer *key, PyObject *limits,
                           uint64_t ack, int busy, const core_inline *bufs, Py_ssize_t nbuf,
                           uint64_t peer_max) {
    if (read_limits(limits) < 0) return NULL;
    /* encode()'s checks, as they fall for a message without buffers or
     * with inline ones only. */
    uint64_t plen = (uint64_t)head->len + (uint64_t)body->len;
    if (plen > UINT32_MAX) {
        core_frame_errorf("payload of %llu bytes; a frame carries at most 4 GiB",
                     (unsigned long long)plen);
        return NULL;
    }
    if ((u128)nbuf > lim.max_buffers || nbuf > 0xFFFF) Py_RETURN_NONE;
    uint64_t head_len = PREFIX_LEN + (uint64_t)DESC_LEN * (uint64_t)nbuf + plen;
    u128 cursor = core_align(head_len), total = 0;
    int any_inline = 0;
    if (nbuf) {
        /* encode()'s layout: each buffer 64-byte aligned after the
         * payload, within inline_total and both sides' frame limits. */
        u128 cap = lim.max_frame_bytes < peer_max ? lim.max_frame_bytes : peer_max;
        u128 budget = cursor + lim.inline_total, frame_cap = cap > MAC_LEN ? cap - MAC_LEN : 0;
        if (budget > frame_cap) budget = frame_cap;
        for (Py_ssize_t i = 0; i < nbuf; i++) {
            total += bufs[i].len; /* (counted, inline or not, as encode() does) */
            if (bufs[i].remote) continue;
            u128 end = align_up128(cursor + bufs[i].len);
            if (bufs[i].len > lim.inline_threshold || end > budget) Py_RETURN_NONE;
            cursor = end;
            any_inline = 1;
        }
    }
    uint64_t size = (any_inline ? (uint64_t)cursor : head_len) + MAC_LEN;
    if (size > lim.max_frame_bytes) {
        over_limit("frame", size, "max_frame_bytes", lim.max_frame_bytes);
        return NULL;
    }
    /* (encode() counts a buffer's bytes whether inline or not) */
    if (kind != KIND_BATCH && size + total > lim.max_message_bytes) {
        over_limit("message", size + total, "max_message_bytes", lim.max_message_bytes);
        return NULL;
    }
    /* bytes, not a numpy array: filled here before anyone sees it, then
     * never written again, and made without a call into numpy (~0.4 µs a
     * frame on the project's VM).  UCX reads it through the buffer
     * protocol; the request keeps it. */
    PyObject *frame = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (!frame) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(frame);
    put_prefix(p, kind, nbuf, busy, (uint32_t)plen, seq, ack);
    uint64_t where = core_align(head_len);
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        uint8_t *d = p + PREFIX_LEN + DESC_LEN * i;
        put64(d, bufs[i].len);
        put16(d + 16, (uint16_t)(int16_t)-1); /* host memory */
        d[19] = 0;
        put32(d + 20, 0);
        if (bufs[i].remote) { /* its address, for the peer to read */
            put64(d + 8, (uint64_t)(uintptr_t)bufs[i].ptr);
            d[18] = REMOTE;
            continue;
        }
        put64(d + 8, where);
        d[18] = 0;
        where = core_align(where + bufs[i].len);
    }
    uint8_t *q = p + PREFIX_LEN + DESC_LEN * nbuf;
    memcpy(q, head->buf, (size_t)head->len);
    memcpy(q + head->len, body->buf, (size_t)body->len);
    if (any_inline) {
        /* Each buffer copied in, and the gaps that align them zeroed, as
         * in encode(): no stale heap bytes to the peer.  (An empty
         * tensor's address may be 0: nothing is copied from it.) */
        where = core_align(head_len);
        memset(p + head_len, 0, (size_t)(where - head_len));
        for (Py_ssize_t i = 0; i < nbuf; i++) {
            if (bufs[i].remote) continue;
            uint64_t end = where + bufs[i].len, next = core_align(end);
            if (bufs[i].len) memcpy(p + where, bufs[i].ptr, (size_t)bufs[i].len);
            memset(p + end, 0, (size_t)(next - end));
            where = next;
        }
    }
    if (!key)
        memset(p + size - MAC_LEN, 0, MAC_LEN); /* inside a BATCH, whose MAC covers it */
    else if (mac_into(key, p, (size_t)head_len, size, p + size - MAC_LEN) < 0) {
        Py_DECREF(frame);
        return NULL;
    }
    return frame;
}

/* A tuple subclass instance (Frame, BufferDesc: NamedTuples) of n items,
 * stolen from `items`, made as structseq makes its instances: without
 * calling the class's Python __new__. */
static PyObject *named(PyTypeObject *type, Py_ssize_t n, PyObject **items) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (!items[i]) {
            for (Py_ssize_t j = 0; j < n; j++) Py_XDECREF(items[j]);
            return NULL;
        }
    PyObject *t = type->tp_alloc(type, n);
    if (!t) {
        for (Py_ssize_t j = 0; j < n; j++) Py_DECREF(items[j]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

/* The inline range [off, off + nbytes) named in an error, exactly (the sum
 * can pass 2**64 in a lying frame). */
static void inline_error(Py_ssize_t i, uint64_t off, uint64_t nbytes, Py_ssize_t n) {
    PyObject *end = u128_long((u128)off + nbytes);
    if (end) {
        core_frame_errorf("buffer %zd claims inline bytes [%llu, %S) outside the %zd-byte frame", i,
                     (unsigned long long)off, end, n);
        Py_DECREF(end);
    }
}

typedef struct {
    uint64_t nbytes, where;
    int16_t device;
    uint8_t flags;
    uint32_t arg;
} desc;

static int flags_known(uint8_t f) {
    return f == 0 || f == STAGED || f == PACK || f == (PACK | STAGED) || f == PACKED ||
           f == REMOTE || f == WRITTEN;
}

/* The descriptors of staged, packed, remote and written buffers checked,
 * their bytes counted; returns the index of the first pack (the buffers
 * handed up) or -1 with FrameError set. */
static Py_ssize_t check_ways(const desc *d, Py_ssize_t nbuf, u128 *total) {
    Py_ssize_t first_pack = nbuf;
    for (Py_ssize_t i = 0; i < nbuf; i++)
        if (d[i].flags & PACK) {
            first_pack = i;
            break;
        }
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        uint8_t f = d[i].flags;
        if (!flags_known(f))
            return core_frame_errorf("buffer %zd has unknown flags 0x%x", i, f);
        if (!!(f & PACK) != (i >= first_pack))
            return core_frame_errorf("buffer %zd: packs must come after every other buffer", i);
        if ((f & STAGED) && d[i].arg < MIN_CHUNK_KIB)
            return core_frame_errorf("buffer %zd is staged in chunks of %u KiB; the minimum is %d KiB",
                                i, d[i].arg, MIN_CHUNK_KIB);
        if ((f & (STAGED | PACK)) || f == REMOTE || f == WRITTEN) {
            *total += d[i].nbytes;
            if (f == REMOTE && d[i].device != -1)
                return core_frame_errorf("buffer %zd is to be read by address from device %d; only "
                                    "host memory can be", i, d[i].device);
            if (f == WRITTEN && d[i].device != -1)
                return core_frame_errorf("buffer %zd was written into host memory here, but its "
                                    "descriptor names device %d", i, d[i].device);
        } else if (f == PACKED) {
            if (!(first_pack <= (Py_ssize_t)d[i].arg && (Py_ssize_t)d[i].arg < nbuf))
                return core_frame_errorf("buffer %zd claims to sit in buffer %u, which is not a pack",
                                    i, d[i].arg);
            const desc *pack = &d[d[i].arg];
            if ((u128)d[i].where + d[i].nbytes > pack->nbytes ||
                d[i].device != pack->device) {
                PyObject *end = u128_long((u128)d[i].where + d[i].nbytes);
                if (end) {
                    core_frame_errorf("buffer %zd claims bytes [%llu, %S) on device %d of a "
                                 "%llu-byte pack on device %d", i,
                                 (unsigned long long)d[i].where, end, d[i].device,
                                 (unsigned long long)pack->nbytes, pack->device);
                    Py_DECREF(end);
                }
                return -1;
            }
        }
    }
    return first_pack;
}

/* decode(raw, key, limits) -> Frame, as documented on
 * ucxrpc.transport.wire.frame.decode. */
static PyObject *frame_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "decode() takes 3 arguments (raw, key, limits)");
        return NULL;
    }
    if (!frame_type) {
        PyErr_SetString(PyExc_RuntimeError, "ucxrpc._core.frame_bind() was not called");
        return NULL;
    }
    PyObject *raw = args[0], *key_o = args[1];
    if (read_limits(args[2]) < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(raw, &b, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *p = b.buf;
    Py_ssize_t n = b.len;
    PyObject *result = NULL, *descs = NULL;
    desc few[8], *d = NULL;
    if (n < PREFIX_LEN + MAC_LEN) {
        core_frame_errorf("truncated frame: %zd bytes is shorter than a frame header", n);
        goto done;
    }
    if (p[0] != MAGIC0 || p[1] != MAGIC1) {
        PyObject *m = PyBytes_FromStringAndSize((const char *)p, 2);
        if (m) {
            core_frame_errorf("bad frame magic %R", m);
            Py_DECREF(m);
        }
        goto done;
    }
    if (p[2] != VERSION) {
        core_frame_errorf("frame version %d not supported (this side speaks %d)", p[2], VERSION);
        goto done;
    }
    PyObject *kind = p[3] < NKINDS ? kinds[p[3]] : NULL;
    if (!kind) {
        core_frame_errorf("unknown frame kind %d", p[3]);
        goto done;
    }
    uint16_t nbuf = get16(p + 4), state = get16(p + 6);
    uint32_t plen = get32(p + 8);
    uint64_t seq = get64(p + 12), ack = get64(p + 20);
    if (state & ~BUSY) {
        core_frame_errorf("unknown frame state bits 0x%04x", state);
        goto done;
    }
    if (nbuf > lim.max_buffers) {
        core_frame_errorf("frame declares %u buffers; the limit is %u", nbuf,
                     (unsigned)lim.max_buffers);  /* under nbuf, so under 65536 */
        goto done;
    }
    uint64_t head_len = PREFIX_LEN + (uint64_t)DESC_LEN * nbuf + plen;
    if (head_len + MAC_LEN > (uint64_t)n) {
        core_frame_errorf("truncated frame: header declares %llu bytes, got %zd",
                     (unsigned long long)(head_len + MAC_LEN), n);
        goto done;
    }
    if (key_o != Py_None) {
        Py_buffer key;
        if (PyObject_GetBuffer(key_o, &key, PyBUF_SIMPLE) < 0) goto done;
        uint8_t want[MAC_LEN];
        int rc = mac_into(&key, p, (size_t)head_len, (uint64_t)n, want);
        PyBuffer_Release(&key);
        if (rc < 0) goto done;
        /* In constant time: a byte-by-byte early exit would tell a forger,
         * by timing, how much of a guessed MAC was right. */
        unsigned diff = 0;
        for (int i = 0; i < MAC_LEN; i++) diff |= want[i] ^ p[n - MAC_LEN + i];
        if (diff) {
            core_frame_errorf("frame authentication failed (MAC mismatch)");
            goto done;
        }
    }
    d = nbuf <= 8 ? few : PyMem_Malloc(sizeof(desc) * nbuf);
    if (!d) {
        PyErr_NoMemory();
        goto done;
    }
    u128 total = (uint64_t)n;
    int flagged = 0;
    uint64_t room = (uint64_t)n - MAC_LEN;
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        const uint8_t *q = p + PREFIX_LEN + DESC_LEN * i;
        d[i].nbytes = get64(q);
        d[i].where = get64(q + 8);
        d[i].device = (int16_t)get16(q + 16);
        d[i].flags = q[18];
        d[i].arg = get32(q + 20);
        if (d[i].flags)
            flagged = 1;
        else if (d[i].where == NOT_INLINE)
            total += d[i].nbytes;
        else if (d[i].where < head_len || d[i].where > room || d[i].nbytes > room - d[i].where) {
            inline_error(i, d[i].where, d[i].nbytes, n);
            goto done;
        }
    }
    Py_ssize_t delivered = -1;
    if (flagged && (delivered = check_ways(d, nbuf, &total)) < 0) goto done;

    descs = PyTuple_New(nbuf);
    if (!descs) goto done;
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        PyObject *items[5] = {PyLong_FromUnsignedLongLong(d[i].nbytes),
                              PyLong_FromUnsignedLongLong(d[i].where),
                              PyLong_FromLong(d[i].device), PyLong_FromLong(d[i].flags),
                              PyLong_FromUnsignedLong(d[i].arg)};
        PyObject *one = named(desc_type, 5, items);
        if (!one) goto done;
        PyTuple_SET_ITEM(descs, i, one);
    }
    /* The payload as a view of the received bytes (not a copy): the
     * memoryview holds `raw` alive for as long as it is used. */
    PyObject *payload = NULL, *mv = PyMemoryView_FromObject(raw);
    if (mv) {
        PyObject *sl, *lo = PyLong_FromUnsignedLongLong(head_len - plen);
        PyObject *hi = PyLong_FromUnsignedLongLong(head_len);
        if (lo && hi && (sl = PySlice_New(lo, hi, NULL))) {
            payload = PyObject_GetItem(mv, sl);
            Py_DECREF(sl);
        }
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        Py_DECREF(mv);
    }
    Py_INCREF(kind);
    Py_INCREF(raw);
    Py_INCREF(descs);
    PyObject *items[9] = {kind,
                          PyLong_FromUnsignedLongLong(seq),
                          payload,
                          descs,
                          raw,
                          u128_long(total),
                          PyLong_FromSsize_t(delivered),
                          PyLong_FromUnsignedLongLong(ack),
                          PyBool_FromLong(state == BUSY)};
    result = named(frame_type, 9, items);
done:
    if (d && d != few) PyMem_Free(d);
    Py_XDECREF(descs);
    PyBuffer_Release(&b);
    return result;
}

PyObject *core_frame_decode(PyObject *raw, PyObject *key, PyObject *limits) {
    PyObject *args[3] = {raw, key, limits};
    return frame_decode(NULL, args, 3);
}

/* frame_bind(Frame, BufferDesc, kinds, FrameError, numpy.empty, numpy.uint8):
 * the Python types decode builds, handed down once by wire/frame.py. */
static PyObject *frame_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "frame_bind() takes 6 arguments");
        return NULL;
    }
    for (int i = 0; i < 2; i++)
        if (!PyType_Check(args[i]) || !PyType_IsSubtype((PyTypeObject *)args[i], &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "Frame and BufferDesc must be tuple subclasses");
            return NULL;
        }
    PyObject *members = PySequence_Fast(args[2], "kinds must be a sequence");
    if (!members) return NULL;
    PyObject *table[NKINDS] = {0};
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(members); i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(members, i);
        long v = PyLong_AsLong(k);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(members);
            return NULL;
        }
        if (v < 0 || v >= NKINDS) {
            Py_DECREF(members);
            PyErr_Format(PyExc_ValueError, "frame kind %ld out of range", v);
            return NULL;
        }
        table[v] = k;
    }
    for (int i = 0; i < NKINDS; i++) {
        Py_XINCREF(table[i]);
        Py_XSETREF(kinds[i], table[i]);
    }
    Py_DECREF(members);
    Py_INCREF(args[0]);
    Py_XSETREF(frame_type, (PyTypeObject *)args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(desc_type, (PyTypeObject *)args[1]);
    Py_INCREF(args[3]);
    Py_XSETREF(frame_error, args[3]);
    Py_INCREF(args[4]);
    Py_XSETREF(np_empty, args[4]);
    Py_INCREF(args[5]);
    Py_XSETREF(np_uint8, args[5]);
    Py_RETURN_NONE;
}

PyMethodDef core_frame_methods[] = {
    {"frame_encode", (PyCFunction)(void (*)(void))frame_encode, METH_FASTCALL | METH_KEYWORDS,
     "encode(kind, seq, payload, buffers, key, limits, ways=None, peer_max_frame=1<<62, "
     "seal=True, ack=0, busy=False) -> (frame, separate): see ucxrpc.transport.wire.frame."},
    {"frame_decode", (PyCFunction)(void (*)(void))frame_decode, METH_FASTCALL,
     "decode(raw, key, limits) -> Frame: see ucxrpc.transport.wire.frame."},
    {"mac", (PyCFunction)(void (*)(void))frame_mac, METH_FASTCALL,
     "mac(key, head, size) -> bytes: SipHash-2-4-128 keyed with key (16 bytes) of head "
     "and size (8 bytes, little endian)."},
    {"frame_bind", (PyCFunction)(void (*)(void))frame_bind, METH_FASTCALL,
     "frame_bind(Frame, BufferDesc, kinds, FrameError, numpy.empty, numpy.uint8)."},
    {NULL, NULL, 0, NULL}};

int core_frame_init(PyObject *module) {
    /* The MAC key's length, stated once: frame.KEY_LEN and the handshake
     * (auth.py) read it from here. */
    return PyModule_AddIntConstant(module, "MAC_KEY_LEN", SIPHASH_KEY_LEN);
}
