/* The frames a turn or a driver's spin took off UCX, handed on in one C
 * call (transport/receive.py's Receiver keeps an Inlet; its `taken` is
 * the Inlet's).
 *
 * Most frames are an authenticated peer's message without buffers (a
 * no-op's request, most replies), one whose buffers all travelled inside
 * the frame (host tensors up to the sender's inline_threshold: a 16 or
 * 64 KiB echo's), or a BATCH of such messages (a burst's, sent behind a
 * frame in flight), whole already and with nothing of an earlier turn to
 * wait behind.  In Python each cost three calls on its way to the agent
 * (Receiver.taken, _message_frame, _hand_on: Run AZ timed the take to the
 * agent's handler at ~4 µs a side on the project's VM), six with inline
 * buffers.  Here such a frame is decoded and checked (frame.c: the MAC,
 * the limits), its sequence number checked and moved on, and its payload
 * (a batch's, each message's in order) handed to the receiver's
 * `_on_message` (the agent's), with its inline buffers as views of the
 * frame (`inline_view(frame, where, nbytes)`), all in this call.  So is
 * a frame that a later turn found whole (`frame`): most frames of more
 * than one shared-memory segment are taken while still arriving.  So is
 * a message whose other buffers its sender left for us to read by address
 * (by_address.py; below the size from which we lend it a grant instead):
 * read here, into the receive pool's memory, with the GIL dropped, and
 * the pipe's read_through and the due word moved on as
 * Receiver._message_decoded and ByAddress.read_done move them; an
 * acknowledgement of our own buffers that a frame carries goes to
 * ByAddress.on_ack from here.  Beside a busy process a 1 MiB echo, read
 * by address both ways, spent ~45 µs a side in the Python around each
 * read (issue 52).  Everything else goes to the Receiver's Python, which
 * handles every case:
 *
 * - a frame not to be handled at once (no pipe or not authenticated yet,
 *   over max_frame_bytes, a handshake frame, one still being received,
 *   one behind an earlier turn's): `queue(tag, length, req, got, sender,
 *   pipe)`;
 * - a frame that decoded but is no plain message (a control frame, one
 *   with a buffer sent apart, written into a grant, staged or on a
 *   device, or read by address from a grant's size on, a BATCH holding a
 *   message with such a buffer or one that does not decode), or one
 *   whose checks have something to say (a replay, a message over
 *   max_message_bytes, a pipe that ended, buffers by address from a peer
 *   we never said we read, or one whose allocation or read failed: the
 *   Python reads again and names it): `decoded(pipe, got, frame, hint)`,
 *   before anything of it was changed here;
 * - a frame that failed its MAC or a check: `judged_bad(pipe, error)`;
 * - a handler that raised an Exception: `handler_failed(pipe, error)`.
 *
 * Whatever else ends the call (a BaseException from a handler, which
 * Python's `except Exception` lets through), the frames not yet looked
 * at are queued first (`queue`), as taken()'s `finally:` did.  The pipe's
 * records are read by their names (pipe.py's `auth`, `inbound`, `cma`),
 * as send.c reads them: the transport's top layer written in C. */
#include "core.h"

#include <errno.h>
#include <structmember.h>
#include <sys/uio.h>

typedef struct {
    PyObject_HEAD
    PyObject *receiver; /* its `frames` (an earlier turn's still waiting), `_on_message` */
    PyObject *pipes, *limits, *queue, *decoded, *judged_bad, *handler_failed;
    PyObject *bad;      /* (AuthenticationError, FrameError): judged, not raised */
    PyObject *message;  /* FrameKind.MESSAGE */
    PyObject *batch;    /* FrameKind.BATCH */
    PyObject *inline_view; /* (frame, where, nbytes) -> a tensor over those bytes */
    PyObject *done;     /* UCP_DONE: a frame received whole when taken */
    int id_shift, kind_shift, handshake;
    uint64_t id_mask, hint_mask, max_frame, max_message;
    /* By address (by_address.py, hostmem/cma.py), or all NULL and
     * read_max 0 (the Python hears of every acknowledgement and reads
     * every buffer): ByAddress.on_ack, the receive pool's alloc(nbytes,
     * phase), ByAddress.due, the largest buffer read here + 1 (from there
     * the Python, which lends grants for those), PAGE. */
    PyObject *on_ack, *alloc_read, *due;
    uint64_t read_max, page;
    unsigned long long handled, passed; /* at once here, and left to Python */
    unsigned long long read_bytes;      /* read by address here */
} Inlet;

static PyObject *str_frames, *str_auth, *str_in_key, *str_inbound, *str_seq, *str_peer_busy,
    *str_abandoned, *str_received, *str_cma, *str_acked, *str_peer_id, *str_on_message,
    *str_reads, *str_pid, *str_read_through, *str_ack_sent, *str_data_ptr;

/* Frame's fields by position (wire/frame.py's Frame NamedTuple), and
 * BufferDesc's. */
enum { F_KIND, F_SEQ, F_PAYLOAD, F_BUFFERS, F_RAW, F_TOTAL, F_DELIVERED, F_ACK, F_BUSY };
enum { D_NBYTES, D_WHERE, D_DEVICE, D_FLAGS, D_ARG, D_FIELDS };
#define REMOTE 8 /* wire/frame.py's way: read out of the sender's memory */

static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* fn(args...) with its result dropped: 0, or -1 with its error. */
static int call_drop(PyObject *fn, PyObject *const *args, size_t n) {
    PyObject *r = PyObject_Vectorcall(fn, args, n, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* The error just raised, if one of `bad`, handed to judged_bad(pipe, it)
 * (0); else -1, still raised. */
static int judge(Inlet *self, PyObject *pipe) {
    if (!PyErr_ExceptionMatches(self->bad)) return -1;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *args[2] = {pipe, v};
    int rc = call_drop(self->judged_bad, args, 2);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return rc;
}

/* Whether every buffer `descs` describes travelled inside its frame,
 * from host memory, or (where `read_max`) is one of host memory to read
 * by address of under read_max bytes, counted in *remote (1): then the
 * message is whole as taken once those are read, and each inline buffer
 * a view of the frame.  0 where one came or comes any other way (frame.c
 * checked that an inline one lies within the frame). */
static int all_inline(PyObject *descs, uint64_t read_max, Py_ssize_t *remote) {
    *remote = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(descs); i++) {
        PyObject *d = PyTuple_GET_ITEM(descs, i);
        if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != D_FIELDS) return 0;
        uint64_t where = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(d, D_WHERE));
        uint64_t nbytes = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(d, D_NBYTES));
        long device = PyLong_AsLong(PyTuple_GET_ITEM(d, D_DEVICE));
        long flags = PyLong_AsLong(PyTuple_GET_ITEM(d, D_FLAGS));
        if (PyErr_Occurred()) return -1;
        if (device != -1) return 0;
        if (flags == REMOTE && nbytes < read_max) {
            ++*remote;
            continue;
        }
        if (flags || where == UINT64_MAX) return 0; /* UINT64_MAX: NOT_INLINE */
    }
    return 1;
}

/* Whether `frame` (a MESSAGE without buffers, with inline ones or ones
 * to read by address only, or a BATCH, without buffers of its own) may be
 * acted on here as far as its pipe is concerned (1), or must go to the
 * Python (0): a replay, an acknowledgement by_address is to hear of where
 * it is not told here (*ack_due: it is), buffers by address from a peer
 * we never said we read, a frame over max_message_bytes, a pipe that
 * ended.  *remote: its buffers to read by address.  -1 on error. */
static int plain(Inlet *self, PyObject *pipe, PyObject *frame, PyObject **inbound,
                 Py_ssize_t *remote, int *ack_due) {
    PyObject *bufs = PyTuple_GET_ITEM(frame, F_BUFFERS);
    *remote = 0;
    *ack_due = 0;
    if (!PyTuple_Check(bufs)) return 0;
    if (PyTuple_GET_SIZE(bufs)) {
        if (PyTuple_GET_ITEM(frame, F_KIND) != self->message) return 0;
        int whole = all_inline(bufs, self->read_max, remote);
        if (whole <= 0) return whole;
    }
    uint64_t seq, last, ack, acked, total;
    if (!(*inbound = PyObject_GetAttr(pipe, str_inbound))) return -1;
    if (core_attr_u64(*inbound, str_seq, &last) < 0) return -1;
    seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(frame, F_SEQ));
    if (seq == (uint64_t)-1 && PyErr_Occurred()) return -1;
    if (seq <= last) return 0; /* a replay: the Python names it */
    ack = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(frame, F_ACK));
    total = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(frame, F_TOTAL));
    if (PyErr_Occurred()) return -1;
    if (total > self->max_message) return 0;
    if (ack || *remote) {
        PyObject *cma = PyObject_GetAttr(pipe, str_cma);
        if (!cma) return -1;
        int rc = core_attr_u64(cma, str_acked, &acked), reads = 1;
        if (rc == 0 && *remote) reads = attr_true(cma, str_reads);
        Py_DECREF(cma);
        if (rc < 0 || reads < 0) return -1;
        if (!reads) return 0; /* the Python says what is wrong */
        if (ack > acked) {
            if (!self->on_ack) return 0; /* by_address hears of it there */
            *ack_due = 1;
        }
    }
    int ended = attr_true(*inbound, str_abandoned);
    return ended < 0 ? -1 : !ended;
}

/* The messages of a BATCH frame (wire/batch.py: count u32, then per
 * message its offset and length, u32 each, from the payload's start),
 * decoded, in a new list of (message, where it starts in `got`, the
 * frame's bytes), where every one is a plain message (no buffers or
 * inline ones only, within max_message_bytes); else None, and the Python
 * takes the whole frame, judging what is wrong with it.  NULL on error. */
static PyObject *batch_messages(Inlet *self, PyObject *frame, PyObject *got) {
    PyObject *payload = PyTuple_GET_ITEM(frame, F_PAYLOAD), *out = NULL;
    Py_buffer b, g;
    if (PyObject_GetBuffer(got, &g, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(payload, &b, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&g);
        return NULL;
    }
    const uint8_t *p = b.buf;
    /* (the payload is a view of the frame: frame.c's decode) */
    uint64_t start = (uint64_t)(p - (const uint8_t *)g.buf);
    uint64_t len = (uint64_t)b.len;
    if (len < 4) goto python;
    uint32_t count = get32(p);
    if (4 + 8 * (uint64_t)count > len) goto python;
    if (!(out = PyList_New(count))) goto done;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t off = get32(p + 4 + 8 * (uint64_t)i), n = get32(p + 8 + 8 * (uint64_t)i);
        if (off + n > len) goto python;
        PyObject *raw = PySequence_GetSlice(payload, (Py_ssize_t)off, (Py_ssize_t)(off + n));
        if (!raw) goto fail;
        PyObject *inner = core_frame_decode(raw, Py_None, self->limits);
        Py_DECREF(raw);
        if (!inner) {
            if (!PyErr_ExceptionMatches(self->bad)) goto fail;
            PyErr_Clear(); /* the Python says what is wrong with it */
            goto python;
        }
        PyObject *at = PyLong_FromUnsignedLongLong(start + off), *pair;
        if (!at || !(pair = PyTuple_Pack(2, inner, at))) {
            Py_XDECREF(at);
            Py_DECREF(inner);
            goto fail;
        }
        Py_DECREF(at);
        Py_DECREF(inner);
        PyList_SET_ITEM(out, i, pair);
        PyObject *bufs = PyTuple_GET_ITEM(inner, F_BUFFERS);
        if (PyTuple_GET_ITEM(inner, F_KIND) != self->message || !PyTuple_Check(bufs))
            goto python;
        Py_ssize_t remote;
        int whole = all_inline(bufs, 0, &remote); /* (none by address in a batch) */
        if (whole < 0) goto fail;
        if (!whole) goto python;
        uint64_t total = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(inner, F_TOTAL));
        if (total == (uint64_t)-1 && PyErr_Occurred()) goto fail;
        if (total > self->max_message) goto python; /* refused one by one there */
    }
    goto done;
python:
    Py_XDECREF(out);
    out = Py_NewRef(Py_None);
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&g);
    return out;
}

/* The buffers of a message whose every buffer is inline (all_inline),
 * as tensors over `got`, the frame's bytes, the message starting at `at`
 * in it (a batch's; else 0): a new list, or NULL. */
static PyObject *inline_buffers(Inlet *self, PyObject *got, PyObject *descs, PyObject *at) {
    Py_ssize_t n = PyTuple_GET_SIZE(descs);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(descs, i), *where = PyTuple_GET_ITEM(d, D_WHERE);
        if (at && !(where = PyNumber_Add(at, where))) {
            Py_CLEAR(out);
            break;
        }
        PyObject *args[3] = {got, where, PyTuple_GET_ITEM(d, D_NBYTES)};
        PyObject *t = PyObject_Vectorcall(self->inline_view, args, 3, NULL);
        if (at) Py_DECREF(where);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    return out;
}

/* `nbytes` at `address` in process `pid` copied to `into`, without the
 * GIL (hostmem/cma.py's read, for a buffer under its SPLIT_BYTES): 0, or
 * the errno. */
static int vm_read(long pid, void *into, uint64_t address, uint64_t nbytes) {
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t done = 0;
    while (done < nbytes) {
        struct iovec here = {(char *)into + done, (size_t)(nbytes - done)};
        struct iovec there = {(void *)(uintptr_t)(address + done), (size_t)(nbytes - done)};
        ssize_t got = process_vm_readv((pid_t)pid, &here, 1, &there, 1, 0);
        if (got <= 0) {
            err = got < 0 ? errno : EFAULT;
            break;
        }
        done += (uint64_t)got;
    }
    Py_END_ALLOW_THREADS
    return err;
}

/* The buffers of a message whose every buffer is inline or to be read by
 * address (all_inline): the inline ones as views of `got`, the others
 * read out of the peer's memory now, each into memory of alloc_read's
 * that starts where the sender's does in its page (the pool's phase: a
 * copy between equal phases runs fastest).  A new list, adding what was
 * read to *nread; Py_None (a new reference) where an allocation or a
 * read failed: nothing of the pipe's was changed, and the Python, which
 * reads them again, says which buffer and why.  NULL on error. */
static PyObject *read_buffers(Inlet *self, PyObject *pipe, PyObject *got, PyObject *descs,
                              uint64_t *nread) {
    Py_ssize_t n = PyTuple_GET_SIZE(descs);
    PyObject *out = PyList_New(n), *cma = NULL;
    long pid = -1;
    uint64_t total = 0;
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(descs, i), *t;
        PyObject *where_o = PyTuple_GET_ITEM(d, D_WHERE), *n_o = PyTuple_GET_ITEM(d, D_NBYTES);
        long flags = PyLong_AsLong(PyTuple_GET_ITEM(d, D_FLAGS));
        if (flags == -1 && PyErr_Occurred()) goto fail;
        if (flags != REMOTE) {
            PyObject *args[3] = {got, where_o, n_o};
            if (!(t = PyObject_Vectorcall(self->inline_view, args, 3, NULL))) goto fail;
            PyList_SET_ITEM(out, i, t);
            continue;
        }
        uint64_t where = PyLong_AsUnsignedLongLong(where_o), nbytes = PyLong_AsUnsignedLongLong(n_o);
        if (PyErr_Occurred()) goto fail;
        if (pid < 0) {
            PyObject *pid_o;
            if (!(cma = PyObject_GetAttr(pipe, str_cma)) || !(pid_o = PyObject_GetAttr(cma, str_pid)))
                goto fail;
            pid = PyLong_AsLong(pid_o);
            Py_DECREF(pid_o);
            if (pid == -1 && PyErr_Occurred()) goto fail;
            if (pid <= 0) goto python;
        }
        PyObject *phase = PyLong_FromUnsignedLongLong(where % self->page);
        if (!phase) goto fail;
        PyObject *args[2] = {n_o, phase};
        t = PyObject_Vectorcall(self->alloc_read, args, 2, NULL);
        Py_DECREF(phase);
        if (!t) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) goto fail;
            PyErr_Clear(); /* (out of memory, say: the Python fails the message with it) */
            goto python;
        }
        PyList_SET_ITEM(out, i, t);
        PyObject *ptr_o = PyObject_CallMethodNoArgs(t, str_data_ptr);
        if (!ptr_o) goto fail;
        void *into = PyLong_AsVoidPtr(ptr_o);
        Py_DECREF(ptr_o);
        if (!into && PyErr_Occurred()) goto fail;
        if (vm_read(pid, into, where, nbytes)) goto python;
        total += nbytes;
    }
    Py_XDECREF(cma);
    *nread += total;
    return out;
python:
    Py_XDECREF(cma);
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(cma);
    Py_DECREF(out);
    return NULL;
}

/* We read buffers of the peer's up to its frame `seq` (pipe.cma's
 * read_through, set before the message went on): ByAddress.read_done,
 * the word due unless a frame sent meanwhile carried it. */
static int read_done(Inlet *self, PyObject *pipe, PyObject *cma, uint64_t seq) {
    uint64_t ack_sent;
    if (core_attr_u64(cma, str_ack_sent, &ack_sent) < 0) return -1;
    if (ack_sent >= seq) return 0;
    PyObject *now = PyFloat_FromDouble(core_monotonic());
    if (!now) return -1;
    PyObject *r = PyDict_SetDefault(self->due, pipe, now);
    Py_DECREF(now);
    return r ? 0 : -1;
}

/* One message of `pipe`'s handed to the receiver's handler (the agent's,
 * or a test's put in its place, read at each message) with `bufs` (NULL:
 * none), counted as received; a handler that raises an Exception is
 * logged and the turn goes on.  0, or -1 with what else it raised. */
static int deliver(Inlet *self, PyObject *pipe, PyObject *inbound, PyObject *payload,
                   PyObject *bufs) {
    uint64_t received;
    if (core_attr_u64(inbound, str_received, &received) < 0) return -1;
    PyObject *n = PyLong_FromUnsignedLongLong(received + 1);
    if (!n) return -1;
    int set = PyObject_SetAttr(inbound, str_received, n);
    Py_DECREF(n);
    if (set < 0) return -1;
    int rc = -1;
    bufs = bufs ? Py_NewRef(bufs) : PyList_New(0);
    PyObject *peer = PyObject_GetAttr(pipe, str_peer_id),
             *handler = PyObject_GetAttr(self->receiver, str_on_message);
    if (peer && bufs && handler) {
        self->handled++;
        PyObject *args[3] = {peer, payload, bufs};
        rc = call_drop(handler, args, 3);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_Exception)) {
            /* The agent's handler failed: logged, and the turn goes on. */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_NormalizeException(&t, &v, &tb);
            if (tb) PyException_SetTraceback(v, tb);
            PyObject *fargs[2] = {pipe, v};
            rc = call_drop(self->handler_failed, fargs, 2);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
    }
    Py_XDECREF(peer);
    Py_XDECREF(bufs);
    Py_XDECREF(handler);
    return rc;
}

/* A frame taken whole, of an authenticated peer, nothing waiting before
 * it: handled here where it is a plain message or a batch of them, else
 * by the Python. */
static int at_once(Inlet *self, PyObject *pipe, PyObject *key, PyObject *got, uint64_t hint) {
    PyObject *frame = core_frame_decode(got, key, self->limits);
    if (!frame) return judge(self, pipe);
    PyObject *inbound = NULL, *hint_o = NULL, *batch = NULL, *bufs = NULL, *cma = NULL;
    int rc = -1, ack_due = 0;
    Py_ssize_t remote = 0;
    uint64_t nread = 0;
    PyObject *kind = PyTuple_GET_ITEM(frame, F_KIND);
    int p = kind == self->message || kind == self->batch
        ? plain(self, pipe, frame, &inbound, &remote, &ack_due) : 0;
    if (p > 0 && kind == self->batch) {
        /* A burst's messages, which waited in the sender's outbox behind
         * a frame in flight: each a Python _batch, _deliver and _hand_on
         * fewer (Run BD). */
        if (!(batch = batch_messages(self, frame, got))) goto done;
        p = batch != Py_None;
    }
    if (p > 0 && kind == self->message &&
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(frame, F_BUFFERS))) {
        /* Its buffers, views of the frame or read by address: a
         * Receiver._message_decoded, Incoming, _read, _deliver and
         * _hand_on fewer (issue 52; a 1 MiB echo beside a busy process
         * spent ~45 µs a side there besides the read).  Made before
         * anything moves on, as the Python makes them. */
        PyObject *descs = PyTuple_GET_ITEM(frame, F_BUFFERS);
        bufs = remote ? read_buffers(self, pipe, got, descs, &nread)
                      : inline_buffers(self, got, descs, NULL);
        if (!bufs) goto done;
        if (bufs == Py_None) {
            Py_CLEAR(bufs);
            p = 0; /* a read failed: the Python reads again, and fails the message */
        }
    }
    if (p < 0) goto done;
    if (!p) {
        if (!(hint_o = PyLong_FromUnsignedLongLong(hint))) goto done;
        PyObject *args[4] = {pipe, got, frame, hint_o};
        rc = call_drop(self->decoded, args, 4) < 0 ? judge(self, pipe) : 0;
        goto done;
    }
    if (PyObject_SetAttr(inbound, str_seq, PyTuple_GET_ITEM(frame, F_SEQ)) < 0 ||
        PyObject_SetAttr(inbound, str_peer_busy, PyTuple_GET_ITEM(frame, F_BUSY)) < 0)
        goto done;
    if (ack_due) {
        /* Our buffers it read: let them go (the Python's order: before
         * what the frame holds; a FrameError there is the frame's). */
        PyObject *args[2] = {pipe, PyTuple_GET_ITEM(frame, F_ACK)};
        if (call_drop(self->on_ack, args, 2) < 0) {
            rc = judge(self, pipe);
            goto done;
        }
    }
    if (remote) {
        /* Before delivering: a reply sent meanwhile carries the word. */
        self->read_bytes += nread;
        if (!(cma = PyObject_GetAttr(pipe, str_cma)) ||
            PyObject_SetAttr(cma, str_read_through, PyTuple_GET_ITEM(frame, F_SEQ)) < 0)
            goto done;
    }
    if (!batch) {
        rc = deliver(self, pipe, inbound, PyTuple_GET_ITEM(frame, F_PAYLOAD), bufs);
        if (rc == 0 && remote) {
            uint64_t seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(frame, F_SEQ));
            rc = seq == (uint64_t)-1 && PyErr_Occurred() ? -1 : read_done(self, pipe, cma, seq);
        }
        goto done;
    }
    rc = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch) && rc == 0; i++) {
        /* As Receiver._hand_on: a handler may have ended the pipe (its
         * calls were failed then); the rest of the batch is dropped. */
        int ended = i ? attr_true(inbound, str_abandoned) : 0;
        if (ended) {
            rc = ended < 0 ? -1 : 0;
            break;
        }
        PyObject *inner = PyTuple_GET_ITEM(PyList_GET_ITEM(batch, i), 0),
                 *descs = PyTuple_GET_ITEM(inner, F_BUFFERS), *views = NULL;
        if (PyTuple_GET_SIZE(descs) &&
            !(views = inline_buffers(self, got, descs,
                                     PyTuple_GET_ITEM(PyList_GET_ITEM(batch, i), 1)))) {
            rc = -1;
            break;
        }
        rc = deliver(self, pipe, inbound, PyTuple_GET_ITEM(inner, F_PAYLOAD), views);
        Py_XDECREF(views);
    }
done:
    Py_XDECREF(inbound);
    Py_XDECREF(hint_o);
    Py_XDECREF(batch);
    Py_XDECREF(bufs);
    Py_XDECREF(cma);
    Py_DECREF(frame);
    return rc;
}

/* One taken frame, (tag, length, req, got). */
static int one(Inlet *self, PyObject *item) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
        PyErr_SetString(PyExc_TypeError, "a taken frame is (tag, length, req, got)");
        return -1;
    }
    PyObject *tag_o = PyTuple_GET_ITEM(item, 0), *len_o = PyTuple_GET_ITEM(item, 1),
             *req = PyTuple_GET_ITEM(item, 2), *got = PyTuple_GET_ITEM(item, 3);
    uint64_t tag = PyLong_AsUnsignedLongLong(tag_o), length = PyLong_AsUnsignedLongLong(len_o);
    if (PyErr_Occurred()) return -1;
    PyObject *sender = PyLong_FromUnsignedLongLong((tag >> self->id_shift) & self->id_mask);
    if (!sender) return -1;
    PyObject *pipe = PyDict_GetItemWithError(self->pipes, sender), *key = NULL;
    int rc = -1;
    if (!pipe && PyErr_Occurred()) goto done;
    Py_XINCREF(pipe);
    if (pipe && length <= self->max_frame && (int)(tag >> self->kind_shift) != self->handshake &&
        req == self->done) {
        PyObject *auth = PyObject_GetAttr(pipe, str_auth);
        if (!auth) goto done;
        key = PyObject_GetAttr(auth, str_in_key);
        Py_DECREF(auth);
        if (!key) goto done;
        PyObject *frames = PyObject_GetAttr(self->receiver, str_frames);
        if (!frames) goto done;
        int waiting = PyObject_IsTrue(frames);
        Py_DECREF(frames);
        if (waiting < 0) goto done;
        if (key != Py_None && !waiting) {
            rc = at_once(self, pipe, key, got, tag & self->hint_mask);
            goto done;
        }
    }
    self->passed++;
    PyObject *args[6] = {tag_o, len_o, req, got, sender, pipe ? pipe : Py_None};
    rc = call_drop(self->queue, args, 6);
done:
    Py_XDECREF(key);
    Py_XDECREF(pipe);
    Py_DECREF(sender);
    return rc;
}

/* taken(frames): see the top of this file. */
static PyObject *inlet_taken(Inlet *self, PyObject *taken) {
    if (!PyList_Check(taken)) {
        PyErr_SetString(PyExc_TypeError, "taken() takes a list of taken frames");
        return NULL;
    }
    Py_INCREF(taken);
    Py_ssize_t i = 0, n = PyList_GET_SIZE(taken);
    for (; i < n; i++)
        if (one(self, PyList_GET_ITEM(taken, i)) < 0) break;
    if (i < n) {
        /* As taken()'s finally: what was not looked at is received and
         * kept (queued); the error that ended the call is raised. */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        for (i++; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(taken, i);
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) continue;
            PyObject *tag_o = PyTuple_GET_ITEM(item, 0);
            uint64_t tag = PyLong_AsUnsignedLongLong(tag_o);
            PyObject *sender = PyErr_Occurred()
                ? NULL : PyLong_FromUnsignedLongLong((tag >> self->id_shift) & self->id_mask);
            PyObject *pipe = sender ? PyDict_GetItemWithError(self->pipes, sender) : NULL;
            if (sender && !PyErr_Occurred()) {
                PyObject *args[6] = {tag_o, PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2),
                                     PyTuple_GET_ITEM(item, 3), sender, pipe ? pipe : Py_None};
                call_drop(self->queue, args, 6);
            }
            Py_XDECREF(sender);
            PyErr_Clear(); /* the first error is the one raised */
        }
        PyErr_Restore(t, v, tb);
        Py_DECREF(taken);
        return NULL;
    }
    Py_DECREF(taken);
    Py_RETURN_NONE;
}

/* frame(pipe, got, hint): a frame of `pipe`'s received whole after it
 * was taken (a turn's Receiver.poll: it was still arriving, as a frame
 * of more than one shared-memory segment is when first found, or it
 * waited behind one that was), from an authenticated peer: handled as
 * taken() handles one at once. */
static PyObject *inlet_frame(Inlet *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "frame() takes (pipe, got, hint)");
        return NULL;
    }
    uint64_t hint = PyLong_AsUnsignedLongLong(args[2]);
    if (hint == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *auth = PyObject_GetAttr(args[0], str_auth);
    if (!auth) return NULL;
    PyObject *key = PyObject_GetAttr(auth, str_in_key);
    Py_DECREF(auth);
    if (!key) return NULL;
    int rc = -1;
    if (key == Py_None)
        PyErr_SetString(PyExc_ValueError, "frame(): the pipe has not authenticated");
    else
        rc = at_once(self, args[0], key, args[1], hint & self->hint_mask);
    Py_DECREF(key);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static int inlet_traverse(Inlet *self, visitproc visit, void *arg) {
    Py_VISIT(self->receiver);
    Py_VISIT(self->pipes);
    Py_VISIT(self->limits);
    Py_VISIT(self->queue);
    Py_VISIT(self->decoded);
    Py_VISIT(self->judged_bad);
    Py_VISIT(self->handler_failed);
    Py_VISIT(self->bad);
    Py_VISIT(self->message);
    Py_VISIT(self->batch);
    Py_VISIT(self->inline_view);
    Py_VISIT(self->done);
    Py_VISIT(self->on_ack);
    Py_VISIT(self->alloc_read);
    Py_VISIT(self->due);
    return 0;
}

static int inlet_clear(Inlet *self) {
    Py_CLEAR(self->receiver);
    Py_CLEAR(self->pipes);
    Py_CLEAR(self->limits);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->decoded);
    Py_CLEAR(self->judged_bad);
    Py_CLEAR(self->handler_failed);
    Py_CLEAR(self->bad);
    Py_CLEAR(self->message);
    Py_CLEAR(self->batch);
    Py_CLEAR(self->inline_view);
    Py_CLEAR(self->done);
    Py_CLEAR(self->on_ack);
    Py_CLEAR(self->alloc_read);
    Py_CLEAR(self->due);
    return 0;
}

static void inlet_dealloc(Inlet *self) {
    PyObject_GC_UnTrack(self);
    inlet_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *const inlet_names[] = {
    "receiver", "pipes", "limits", "queue", "decoded", "judged_bad",
    "handler_failed", "bad", "message", "batch", "done", "inline_view", "id_shift", "id_mask",
    "kind_shift", "handshake", "hint_mask", "max_frame", "max_message", "by_address"};
#define NINLET_NAMES ((Py_ssize_t)(sizeof inlet_names / sizeof inlet_names[0]))
#define NINLET_OBJECTS 12

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* Inlet(receiver, pipes, limits, queue, decoded, judged_bad,
 *       handler_failed, bad, message, batch, done, inline_view, id_shift, id_mask,
 *       kind_shift, handshake, hint_mask, max_frame, max_message, by_address),
 *       keywords only; by_address: (on_ack, alloc_read, due, read_max,
 *       page), or None. */
static PyObject *inlet_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *a[NINLET_NAMES];
    if (core_kwonly("Inlet", inlet_names, NINLET_NAMES, args, kwargs, a) < 0) return NULL;
    if (!PyDict_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "Inlet(): pipes must be a dict");
        return NULL;
    }
    uint64_t v[7], read_max = 0, page = 1;
    for (int i = 0; i < 7; i++)
        if (as_u64(a[NINLET_OBJECTS + i], &v[i]) < 0) return NULL;
    PyObject *reads = a[NINLET_OBJECTS + 7];
    if (reads != Py_None) {
        if (!PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) != 5 ||
            !PyDict_Check(PyTuple_GET_ITEM(reads, 2))) {
            PyErr_SetString(PyExc_TypeError, "Inlet(): by_address is (on_ack, alloc_read, due: "
                            "dict, read_max, page) or None");
            return NULL;
        }
        if (as_u64(PyTuple_GET_ITEM(reads, 3), &read_max) < 0 ||
            as_u64(PyTuple_GET_ITEM(reads, 4), &page) < 0)
            return NULL;
        if (!page) {
            PyErr_SetString(PyExc_ValueError, "Inlet(): page is not 0");
            return NULL;
        }
    }
    if (v[0] > 63 || v[2] > 63) {
        PyErr_SetString(PyExc_ValueError, "Inlet(): a shift is under 64");
        return NULL;
    }
    Inlet *self = (Inlet *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    PyObject **slots[NINLET_OBJECTS] = {
        &self->receiver, &self->pipes, &self->limits, &self->queue,
        &self->decoded, &self->judged_bad, &self->handler_failed, &self->bad, &self->message,
        &self->batch, &self->done, &self->inline_view};
    for (int i = 0; i < NINLET_OBJECTS; i++) {
        Py_INCREF(a[i]);
        *slots[i] = a[i];
    }
    self->id_shift = (int)v[0];
    self->id_mask = v[1];
    self->kind_shift = (int)v[2];
    self->handshake = (int)v[3];
    self->hint_mask = v[4];
    self->max_frame = v[5];
    self->max_message = v[6];
    if (reads != Py_None) {
        self->on_ack = Py_NewRef(PyTuple_GET_ITEM(reads, 0));
        self->alloc_read = Py_NewRef(PyTuple_GET_ITEM(reads, 1));
        self->due = Py_NewRef(PyTuple_GET_ITEM(reads, 2));
        self->read_max = read_max;
        self->page = page;
    }
    return (PyObject *)self;
}

static PyMethodDef inlet_methods[] = {
    {"taken", (PyCFunction)inlet_taken, METH_O,
     "taken(frames): hand on the frames taken off UCX (see csrc/receive.c)."},
    {"frame", (PyCFunction)(void (*)(void))inlet_frame, METH_FASTCALL,
     "frame(pipe, got, hint): an authenticated peer's frame received whole later."},
    {NULL},
};

static PyMemberDef inlet_members[] = {
    {"handled", T_ULONGLONG, offsetof(Inlet, handled), READONLY,
     "messages handed to on_message here"},
    {"passed", T_ULONGLONG, offsetof(Inlet, passed), READONLY,
     "frames queued for the Python (not to be handled at once)"},
    {"read_bytes", T_ULONGLONG, offsetof(Inlet, read_bytes), READONLY,
     "bytes read by address here"},
    {NULL},
};

static PyTypeObject InletType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucxrpc._core.Inlet",
    .tp_basicsize = sizeof(Inlet),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The frames taken off UCX handed on in one call (transport/receive.py).",
    .tp_new = inlet_new,
    .tp_dealloc = (destructor)inlet_dealloc,
    .tp_traverse = (traverseproc)inlet_traverse,
    .tp_clear = (inquiry)inlet_clear,
    .tp_methods = inlet_methods,
    .tp_members = inlet_members,
};

int core_receive_init(PyObject *module) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&str_frames, "frames"}, {&str_auth, "auth"}, {&str_in_key, "in_key"},
        {&str_inbound, "inbound"}, {&str_seq, "seq"}, {&str_peer_busy, "peer_busy"},
        {&str_abandoned, "abandoned"}, {&str_received, "received"}, {&str_cma, "cma"},
        {&str_acked, "acked"}, {&str_peer_id, "peer_id"}, {&str_on_message, "_on_message"},
        {&str_reads, "reads"}, {&str_pid, "pid"}, {&str_read_through, "read_through"},
        {&str_ack_sent, "ack_sent"}, {&str_data_ptr, "data_ptr"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].text))) return -1;
    if (PyType_Ready(&InletType) < 0) return -1;
    Py_INCREF(&InletType);
    if (PyModule_AddObject(module, "Inlet", (PyObject *)&InletType) < 0) {
        Py_DECREF(&InletType);
        return -1;
    }
    return 0;
}
