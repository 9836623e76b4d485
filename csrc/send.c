/* A message without buffers, or whose buffers all go inline, onto its
 * pipe in one C call (transport/send.py's Sender keeps an Outlet and sends
 * every frame without buffers through it).
 *
 * Most messages have no buffers: a no-op's request and reply, most
 * replies, the control frames.  In Python their way from the agent to
 * libucp was seven calls a message (Transport.send, _send_or_queue,
 * Sender.send, _frame_alone, the strategy's look, the envelope's encode
 * and hint: ~4.8 µs a side of a no-op on the project's VM, Run AZ).  Here
 * it is one, `Outlet.send`, and the agent's envelope head and its body are
 * copied into the frame once, not joined first.  Most of the rest carry
 * host tensors small enough to travel inside the frame (up to
 * inline_threshold, 64 KiB): they go this way too, their bytes copied
 * into the frame here as encode() copies them (Run BE).  A small message
 * that waits behind a frame in flight goes into the pipe's outbox here
 * (Sender._queue_small's rule), as most of an rpc_async burst's do.  A
 * host buffer that goes by address (Sender._by_address's rule: the peer
 * reads us, and the buffer is large enough for this loop's and the
 * peer's state) goes as its address, held for the peer until it says it
 * read it, below the size from which a grant may take it instead
 * (Sender._write's, in Python): beside a busy process a 1 MiB echo spent
 * ~45 µs a side in Sender.send (issue 52).
 *
 * What it does is `Sender._frame_alone`'s, under the pipe's own lock (a
 * threading.Lock: taken with its acquire(), which waits without the GIL),
 * inside the thread's guard (Ctrl-C waits for the send to end): the frame
 * made and sealed (frame.c), the pipe's sequence number moved on, the frame
 * given to the endpoint's send_frame (libucp's send, bound to the handle;
 * a test's fake network is below it), and the request watched as _track
 * watches it.  The pipe's records are read by their names (pipe.py's
 * `out`, `auth`, `cma`): this is the transport's top layer written in C,
 * not a layer below it, and the Python records stay the one place that
 * state lives.  Where the message can neither go alone at once nor wait
 * in the outbox (no open pipe, a buffer that is not to go inline, a
 * message too large for a batch), send() changes nothing and says so; the
 * caller takes the Python path, which handles every case. */
#include "core.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *pipes;    /* peer id -> Pipe (the transport's, shared) */
    PyObject *limits;   /* this side's wire.frame.Limits */
    PyObject *strategy; /* its blocked_until says the loop may not poll; or None */
    PyObject *inflight; /* the loop's deque of (request, owner) */
    PyObject *wake;     /* the loop's nudge, for a frame left in flight */
    PyObject *failed;   /* failed(pipe, error): a send that failed at once */
    PyObject *open;     /* OutState.OPEN */
    PyObject *done;     /* UCP_DONE: a request complete when made */
    PyObject *tensor, *uint8; /* torch.Tensor, torch.uint8: what send()'s buffers are */
    PyObject *flush;    /* Sender.flush(pipe): the outbox as one BATCH frame */
    uint64_t frame_base, hint_mask;
    uint64_t inline_max; /* the largest buffer send() takes (0: none) */
    uint64_t frame_max;  /* limits.max_frame_bytes (UINT64_MAX: none), read once */
    /* wire/batch.py's MAX_ITEM, MAX_MESSAGES, MAX_BYTES, BASE; batching 0:
     * nothing queued here (the debug switch that treats host buffers as
     * device ones: Sender._batchable) */
    uint64_t batch_item, batch_messages, batch_bytes, batch_base;
    int batching;
    long message_kind;  /* FrameKind.MESSAGE */
    /* By address (hostmem/cma.py): a buffer of at least read_min (read_busy_min
     * where this loop or the peer's may not poll) and under read_max (from
     * there the Python path, which may write it into a grant instead) goes
     * as its address to a peer that reads us, held in pipe.cma.held until
     * the peer says it read it, the pipe in `holding` meanwhile
     * (Sender._by_address); read_max 0: none goes so here. */
    uint64_t read_min, read_busy_min, read_max;
    PyObject *holding;  /* Sender.holding: a set of pipes */
    unsigned long long sent, queued, declined; /* send()'s: alone, in the outbox, left to
                                                * Python */
    unsigned long long read_buffers; /* buffers send() sent by address */
} Outlet;

static PyObject *str_lock, *str_out, *str_auth, *str_cma, *str_ep, *str_state, *str_outbox,
    *str_last_frame, *str_seq, *str_peer_max_frame, *str_sent, *str_out_key, *str_read_through,
    *str_ack_sent, *str_send_frame, *str_name, *str_acquire, *str_release, *str_done,
    *str_error, *str_blocked_until, *str_append, *str_dtype, *str_is_cpu, *str_data_ptr,
    *str_numel, *str_is_contiguous, *str_outbox_bytes, *str_max_frame_bytes,
    *str_read_by_peer, *str_inbound, *str_peer_busy, *str_held;

static int set_u64(PyObject *o, PyObject *name, uint64_t v) {
    PyObject *n = PyLong_FromUnsignedLongLong(v);
    if (!n) return -1;
    int rc = PyObject_SetAttr(o, name, n);
    Py_DECREF(n);
    return rc;
}

/* Whether the loop may not poll now (the transport's contended()). */
static int contended(Outlet *self) {
    if (self->strategy == Py_None) return 0;
    PyObject *v = PyObject_GetAttr(self->strategy, str_blocked_until);
    if (!v) return -1;
    double until = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (until == -1.0 && PyErr_Occurred()) return -1;
    return core_monotonic() < until;
}

/* A frame's request watched (Sender._track's rule for its frame, here
 * only): in flight, it becomes the pipe's last frame before the loop can
 * see it (a frame the loop saw complete first would stay last_frame, and
 * small messages would wait for it), then the loop's to watch; complete,
 * nothing waits behind it; failed at once, the pipe breaks. */
static int track(Outlet *self, PyObject *pipe, PyObject *out, PyObject *req) {
    if (req == self->done) return PyObject_SetAttr(out, str_last_frame, Py_None);
    PyObject *d = PyObject_GetAttr(req, str_done);
    if (!d) return -1;
    int done = PyObject_IsTrue(d);
    Py_DECREF(d);
    if (done < 0) return -1;
    if (!done) {
        if (PyObject_SetAttr(out, str_last_frame, req) < 0) return -1;
        PyObject *pair = PyTuple_Pack(2, req, pipe);
        if (!pair) return -1;
        PyObject *r = PyObject_CallMethodOneArg(self->inflight, str_append, pair);
        Py_DECREF(pair);
        if (!r) return -1;
        Py_DECREF(r);
        r = PyObject_CallNoArgs(self->wake);
        if (!r) return -1;
        Py_DECREF(r);
        return 0;
    }
    if (PyObject_SetAttr(out, str_last_frame, Py_None) < 0) return -1;
    PyObject *err = PyObject_CallMethodNoArgs(req, str_error);
    if (!err) return -1;
    if (err != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->failed, pipe, err, NULL);
        Py_DECREF(err);
        if (!r) return -1;
        Py_DECREF(r);
        return 0;
    }
    Py_DECREF(err);
    return 0;
}

/* Sender._frame_alone: `head` then `body` as one frame of `kind` on `pipe`
 * (under its lock, its outgoing side open and nothing waiting to go
 * first), with `nbuf` host buffers inline; `out` is pipe.out.  1 sent, 0
 * where the buffers would not all go inline (nothing changed), or -1
 * with the error set (FrameError over a limit, this side's or the
 * peer's). */
static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Whether the buffers of `bufs` marked remote may go by address to
 * `pipe`'s peer now (Sender._by_address's rule; `busy`: this loop may not
 * poll): it reads us, and each is at least the size from which it goes so
 * (1); else 0 (the Python path sends them), -1 on error. */
static int by_address(Outlet *self, PyObject *pipe, PyObject *cma, int busy,
                      const core_inline *bufs, Py_ssize_t nbuf) {
    int reads = attr_true(cma, str_read_by_peer);
    if (reads <= 0) return reads;
    uint64_t least = self->read_busy_min;
    if (!busy) {
        PyObject *inbound = PyObject_GetAttr(pipe, str_inbound);
        if (!inbound) return -1;
        int peer_busy = attr_true(inbound, str_peer_busy);
        Py_DECREF(inbound);
        if (peer_busy < 0) return -1;
        if (!peer_busy) least = self->read_min;
    }
    for (Py_ssize_t i = 0; i < nbuf; i++)
        if (bufs[i].remote && bufs[i].len < least) return 0;
    return 1;
}

/* The tensors of `buffers` sent by address in the frame `seq` to
 * `pipe`, held in pipe.cma.held until the peer says it read them (before
 * the frame goes: its acknowledgement may come at once); the pipe joins
 * `holding`. */
static int hold(Outlet *self, PyObject *pipe, PyObject *cma, uint64_t seq, PyObject *buffers,
                const core_inline *bufs, Py_ssize_t nbuf) {
    PyObject *held = PyList_New(0), *all = NULL, *key = NULL;
    int rc = -1;
    if (!held) return -1;
    for (Py_ssize_t i = 0; i < nbuf; i++)
        if (bufs[i].remote && PyList_Append(held, PyList_GET_ITEM(buffers, i)) < 0) goto done;
    if (!(all = PyObject_GetAttr(cma, str_held)) || !(key = PyLong_FromUnsignedLongLong(seq)) ||
        PyObject_SetItem(all, key, held) < 0 || PySet_Add(self->holding, pipe) < 0)
        goto done;
    self->read_buffers += (unsigned long long)PyList_GET_SIZE(held);
    rc = 0;
done:
    Py_DECREF(held);
    Py_XDECREF(all);
    Py_XDECREF(key);
    return rc;
}

static int alone(Outlet *self, PyObject *pipe, PyObject *out, long kind, uint64_t hint,
                 PyObject *head_o, PyObject *body_o, PyObject *buffers, const core_inline *bufs,
                 Py_ssize_t nbuf, Py_ssize_t nremote) {
    PyObject *auth = NULL, *cma = NULL, *ep = NULL, *key_o = NULL, *ack_o = NULL,
             *frame = NULL, *req = NULL;
    Py_buffer head = {0}, body = {0}, key = {0};
    int rc = -1;
    uint64_t seq, peer_max;
    if (!(auth = PyObject_GetAttr(pipe, str_auth)) || !(cma = PyObject_GetAttr(pipe, str_cma)) ||
        !(ep = PyObject_GetAttr(pipe, str_ep)))
        goto done;
    if (ep == Py_None) {
        PyErr_Format(PyExc_AssertionError, "pipe %R is open without an endpoint", pipe);
        goto done;
    }
    /* Read once: the loop may move it on meanwhile. */
    if (!(ack_o = PyObject_GetAttr(cma, str_read_through))) goto done;
    uint64_t ack = PyLong_AsUnsignedLongLong(ack_o);
    if (ack == (uint64_t)-1 && PyErr_Occurred()) goto done;
    if (!(key_o = PyObject_GetAttr(auth, str_out_key)) || core_attr_u64(out, str_seq, &seq) < 0 ||
        core_attr_u64(out, str_peer_max_frame, &peer_max) < 0)
        goto done;
    int busy = contended(self);
    if (busy < 0) goto done;
    if (nremote) {
        int ok = by_address(self, pipe, cma, busy, bufs, nbuf);
        if (ok <= 0) {
            rc = ok;
            goto done;
        }
    }
    if (PyObject_GetBuffer(head_o, &head, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(body_o, &body, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(key_o, &key, PyBUF_SIMPLE) < 0)
        goto done;
    frame = core_frame_alone(kind, seq + 1, &head, &body, &key, self->limits, ack, busy, bufs,
                             nbuf, peer_max);
    if (!frame) goto done;
    if (frame == Py_None) {
        rc = 0;
        goto done;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(frame);
    if ((uint64_t)n > peer_max) {
        /* Its header alone: a message without buffers has nothing to
         * leave out for the peer's limit. */
        PyObject *name = PyObject_GetAttr(pipe, str_name);
        if (name) {
            core_frame_errorf("frame of %zd bytes exceeds max_frame_bytes=%llu of the "
                              "receiver (%S)", n, (unsigned long long)peer_max, name);
            Py_DECREF(name);
        }
        goto done;
    }
    if (set_u64(out, str_seq, seq + 1) < 0) goto done;
    if (nremote && hold(self, pipe, cma, seq + 1, buffers, bufs, nbuf) < 0) goto done;
    PyObject *tag = PyLong_FromUnsignedLongLong(self->frame_base | (hint & self->hint_mask));
    if (!tag) goto done;
    req = PyObject_CallMethodObjArgs(ep, str_send_frame, frame, tag, NULL);
    Py_DECREF(tag);
    if (!req) goto done;
    uint64_t sent;
    if (PyObject_SetAttr(cma, str_ack_sent, ack_o) < 0 ||
        core_attr_u64(out, str_sent, &sent) < 0 || set_u64(out, str_sent, sent + 1) < 0)
        goto done;
    rc = track(self, pipe, out, req) < 0 ? -1 : 1;
done:
    if (head.obj) PyBuffer_Release(&head);
    if (body.obj) PyBuffer_Release(&body);
    if (key.obj) PyBuffer_Release(&key);
    Py_XDECREF(auth);
    Py_XDECREF(cma);
    Py_XDECREF(ep);
    Py_XDECREF(key_o);
    Py_XDECREF(ack_o);
    Py_XDECREF(frame);
    Py_XDECREF(req);
    return rc;
}

static int as_hint(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* frame(pipe, kind, hint, head, body): Sender._frame_alone, the caller
 * holding the pipe's lock. */
static PyObject *outlet_frame(Outlet *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "frame() takes 5 arguments (pipe, kind, hint, head, "
                        "body)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[1]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    uint64_t hint;
    if (as_hint(args[2], &hint) < 0) return NULL;
    PyObject *out = PyObject_GetAttr(args[0], str_out);
    if (!out) return NULL;
    int rc = alone(self, args[0], out, kind, hint, args[3], args[4], NULL, NULL, 0, 0);
    Py_DECREF(out);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* track(pipe, req): a frame's request watched, as the frames sent here are
 * (Sender._track, for a frame sent with its buffers or a BATCH). */
static PyObject *outlet_track(Outlet *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "track() takes 2 arguments (pipe, req)");
        return NULL;
    }
    PyObject *out = PyObject_GetAttr(args[0], str_out);
    if (!out) return NULL;
    int rc = track(self, args[0], out, args[1]);
    Py_DECREF(out);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* How a message may go on `out` now (-1 on error). */
enum { NOT_OPEN, ALONE, BEHIND };

/* ALONE: open, nothing in its outbox and no frame in flight for small
 * messages to wait behind (batch.py); BEHIND: open, but one of those. */
static int way(Outlet *self, PyObject *out) {
    PyObject *v = PyObject_GetAttr(out, str_state);
    if (!v) return -1;
    int open = v == self->open;
    Py_DECREF(v);
    if (!open) return NOT_OPEN;
    if (!(v = PyObject_GetAttr(out, str_last_frame))) return -1;
    int idle = v == Py_None;
    Py_DECREF(v);
    if (!idle) return BEHIND;
    if (!(v = PyObject_GetAttr(out, str_outbox))) return -1;
    Py_ssize_t waiting = PyObject_Length(v);
    Py_DECREF(v);
    return waiting < 0 ? -1 : waiting ? BEHIND : ALONE;
}

/* (wire/batch.py's cost: a message's table entry, two u32, and its frame
 * aligned as pack() places it) */
static inline uint64_t batch_cost(uint64_t n) { return 8 + core_align(n); }

static int call_flush(Outlet *self, PyObject *pipe) {
    PyObject *r = PyObject_CallOneArg(self->flush, pipe);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Sender._queue_small for a message BEHIND on `pipe` (under its lock):
 * encoded unsealed with its hint where a frame's sequence number goes,
 * into the pipe's outbox, which is sent as one BATCH frame (Sender.flush)
 * once full, or at once where nothing is in flight any more.  1 queued, 0
 * where it is not to wait (over batch.MAX_ITEM, a buffer not inline, too
 * large for a batch to the peer: nothing changed, and the Python sends
 * what waits, then the message), -1 on error. */
static int queue(Outlet *self, PyObject *pipe, PyObject *out, uint64_t hint, PyObject *head_o,
                 PyObject *body_o, const core_inline *bufs, Py_ssize_t nbuf) {
    Py_buffer head = {0}, body = {0};
    PyObject *inner = NULL, *v = NULL, *outbox = NULL;
    int rc = -1;
    uint64_t peer_max, outbox_bytes, total;
    if (PyObject_GetBuffer(head_o, &head, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(body_o, &body, PyBUF_SIMPLE) < 0)
        goto done;
    total = (uint64_t)head.len + (uint64_t)body.len;
    for (Py_ssize_t i = 0; i < nbuf; i++) total += bufs[i].len;
    rc = 0;
    if (total > self->batch_item) goto done;
    rc = -1;
    if (core_attr_u64(out, str_peer_max_frame, &peer_max) < 0) goto done;
    uint64_t cap = self->batch_bytes;
    if (peer_max < cap) cap = peer_max;
    if (self->frame_max < cap) cap = self->frame_max;
    rc = 0;
    if (cap <= 256) goto done;
    cap -= 256; /* (the BATCH frame's own header and MAC) */
    rc = -1;
    inner = core_frame_alone(self->message_kind, hint, &head, &body, NULL, self->limits, 0, 0,
                             bufs, nbuf, peer_max);
    if (!inner) goto done;
    rc = 0;
    if (inner == Py_None || (uint64_t)PyBytes_GET_SIZE(inner) > cap) goto done;
    rc = -1;
    uint64_t cost = batch_cost((uint64_t)PyBytes_GET_SIZE(inner));
    if (core_attr_u64(out, str_outbox_bytes, &outbox_bytes) < 0) goto done;
    if ((outbox_bytes ? outbox_bytes : self->batch_base) + cost > cap) {
        if (call_flush(self, pipe) < 0 || core_attr_u64(out, str_outbox_bytes, &outbox_bytes) < 0)
            goto done;
    }
    outbox_bytes = (outbox_bytes ? outbox_bytes : self->batch_base) + cost;
    if (set_u64(out, str_outbox_bytes, outbox_bytes) < 0) goto done;
    if (!(outbox = PyObject_GetAttr(out, str_outbox)) || PyList_Append(outbox, inner) < 0)
        goto done;
    if (!(v = PyObject_GetAttr(out, str_last_frame))) goto done;
    Py_ssize_t waiting = PyObject_Length(outbox);
    if (waiting < 0) goto done;
    if (((uint64_t)waiting >= self->batch_messages || v == Py_None) && call_flush(self, pipe) < 0)
        goto done;
    self->queued++;
    rc = 1;
done:
    if (head.obj) PyBuffer_Release(&head);
    if (body.obj) PyBuffer_Release(&body);
    Py_XDECREF(inner);
    Py_XDECREF(v);
    Py_XDECREF(outbox);
    return rc;
}

/* Put aside what is raised, leave the guard, and raise it again, or
 * whatever leaving raised (a held Ctrl-C) with it as its context, as a
 * `finally:` would (loop.c's drive does the same). */
static void unguard_raising(int outer) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (core_unguard(outer) == 0) {
        PyErr_Restore(t, v, tb);
        return;
    }
    core_chain_over(t, v, tb);
}

/* Where every one of `buffers` (a list) is a contiguous host tensor of
 * bytes of at most inline_max, or one of a size that may go by address
 * (from read_busy_min, under read_max: marked remote, and counted in
 * *nremote; alone() applies the rule that holds now), its address and
 * length into `bufs` (1); 0 where one is not (a Gather, a device tensor,
 * another size: encode() and the by-address and staging rules decide for
 * those), -1 on error. */
static int spans(Outlet *self, PyObject *buffers, core_inline *bufs, Py_ssize_t *nremote) {
    *nremote = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(buffers); i++) {
        PyObject *t = PyList_GET_ITEM(buffers, i), *v;
        if (Py_TYPE(t) != (PyTypeObject *)self->tensor) return 0;
        if (!(v = PyObject_GetAttr(t, str_dtype))) return -1;
        int bytes = v == self->uint8;
        Py_DECREF(v);
        if (!bytes) return 0;
        if (!(v = PyObject_GetAttr(t, str_is_cpu))) return -1;
        int host = v == Py_True;
        Py_DECREF(v);
        if (!host) return 0;
        /* (the agent's are: serialization's _as_bytes makes them; a
         * caller of Transport.send may pass any) */
        if (!(v = PyObject_CallMethodNoArgs(t, str_is_contiguous))) return -1;
        int whole = v == Py_True;
        Py_DECREF(v);
        if (!whole) return 0;
        if (!(v = PyObject_CallMethodNoArgs(t, str_numel))) return -1;
        unsigned long long n = PyLong_AsUnsignedLongLong(v);
        Py_DECREF(v);
        if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        int remote = n > self->inline_max;
        if (remote && (n < self->read_busy_min || n >= self->read_max)) return 0;
        if (!(v = PyObject_CallMethodNoArgs(t, str_data_ptr))) return -1;
        void *p = PyLong_AsVoidPtr(v);
        Py_DECREF(v);
        if (!p && PyErr_Occurred()) return -1;
        bufs[i].ptr = p;
        bufs[i].len = n;
        bufs[i].remote = remote;
        *nremote += remote;
    }
    return 1;
}

/* send(peer, hint, head, body[, buffers]) -> bool: a message of `head`
 * then `body` to worker id `peer` as a frame alone, with `buffers` (a
 * list) inline, or into its pipe's outbox where something waits to go
 * first (True); False where it can do neither (no pipe to it, not open, a
 * buffer that is not to go inline, a message that may not wait in an
 * outbox): nothing was changed, and Transport.send takes it.
 *
 * Raises FrameError over a limit, BrokenError where the endpoint refuses,
 * KeyboardInterrupt held meanwhile. */
static PyObject *outlet_send(Outlet *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "send() takes 4 or 5 arguments (peer, hint, head, body"
                        "[, buffers])");
        return NULL;
    }
    if (nargs == 5 && !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "send(): buffers must be a list");
        return NULL;
    }
    uint64_t hint;
    if (as_hint(args[1], &hint) < 0) return NULL;
    Py_ssize_t nbuf = nargs == 5 ? PyList_GET_SIZE(args[4]) : 0, nremote = 0;
    core_inline few[8], *bufs = few;
    if (nbuf) {
        /* Looked at before the pipe's lock is taken: most messages that
         * do not go inline are large ones. */
        if (!self->inline_max) goto declined;
        if (nbuf > 8 && !(bufs = PyMem_Malloc(sizeof(core_inline) * (size_t)nbuf)))
            return PyErr_NoMemory();
        int ok = spans(self, args[4], bufs, &nremote);
        if (ok <= 0) {
            if (bufs != few) PyMem_Free(bufs);
            if (ok < 0) return NULL;
            goto declined;
        }
    }
    PyObject *pipe = PyDict_GetItemWithError(self->pipes, args[0]);
    if (!pipe) {
        if (bufs != few) PyMem_Free(bufs);
        if (PyErr_Occurred()) return NULL;
        goto declined;
    }
    Py_INCREF(pipe);
    PyObject *lock = NULL, *out = NULL, *r;
    int outer = core_guard(), rc = -1, locked = 0, went = NOT_OPEN;
    if (!(lock = PyObject_GetAttr(pipe, str_lock)) || !(out = PyObject_GetAttr(pipe, str_out)))
        goto done;
    if (!(r = PyObject_CallMethodNoArgs(lock, str_acquire))) goto done;
    Py_DECREF(r);
    locked = 1;
    went = rc = way(self, out);
    if (rc == ALONE)
        rc = alone(self, pipe, out, self->message_kind, hint, args[2], args[3],
                   nargs == 5 ? args[4] : NULL, bufs, nbuf, nremote);
    else if (rc == BEHIND) /* (one by address is large: it waits for no batch) */
        rc = self->batching && !nremote
            ? queue(self, pipe, out, hint & self->hint_mask, args[2], args[3], bufs, nbuf) : 0;
done:
    if (bufs != few) PyMem_Free(bufs);
    if (locked) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        r = PyObject_CallMethodNoArgs(lock, str_release);
        if (r) {
            Py_DECREF(r);
            PyErr_Restore(t, v, tb);
        } else {
            rc = -1;
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
    }
    Py_XDECREF(lock);
    Py_XDECREF(out);
    Py_DECREF(pipe);
    if (rc < 0) {
        unguard_raising(outer);
        return NULL;
    }
    if (core_unguard(outer) < 0) return NULL;
    if (rc) {
        if (went == ALONE) self->sent++;
        Py_RETURN_TRUE;
    }
declined:
    self->declined++;
    Py_RETURN_FALSE;
}

/* queue(pipe, hint, head, body, buffers) -> bool: the message into the
 * outbox of `pipe`, whose lock the caller holds (Sender._queue_small),
 * by queue()'s rule; False where it may not wait (nothing changed). */
static PyObject *outlet_queue(Outlet *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "queue() takes (pipe, hint, head, body, buffers: list)");
        return NULL;
    }
    uint64_t hint;
    if (as_hint(args[1], &hint) < 0) return NULL;
    Py_ssize_t nbuf = PyList_GET_SIZE(args[4]);
    if (!self->batching || (nbuf && !self->inline_max)) Py_RETURN_FALSE;
    core_inline few[8], *bufs = few;
    if (nbuf > 8 && !(bufs = PyMem_Malloc(sizeof(core_inline) * (size_t)nbuf)))
        return PyErr_NoMemory();
    Py_ssize_t nremote;
    int rc = spans(self, args[4], bufs, &nremote);
    if (rc > 0 && nremote) rc = 0; /* (one by address is large: it waits for no batch) */
    PyObject *out = NULL;
    if (rc > 0) {
        if ((out = PyObject_GetAttr(args[0], str_out)))
            rc = queue(self, args[0], out, hint & self->hint_mask, args[2], args[3], bufs, nbuf);
        else
            rc = -1;
    }
    Py_XDECREF(out);
    if (bufs != few) PyMem_Free(bufs);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/* contended() -> bool: whether the loop may not poll now. */
static PyObject *outlet_contended(Outlet *self, PyObject *unused) {
    int c = contended(self);
    if (c < 0) return NULL;
    return PyBool_FromLong(c);
}

static int outlet_traverse(Outlet *self, visitproc visit, void *arg) {
    Py_VISIT(self->pipes);
    Py_VISIT(self->limits);
    Py_VISIT(self->strategy);
    Py_VISIT(self->inflight);
    Py_VISIT(self->wake);
    Py_VISIT(self->failed);
    Py_VISIT(self->open);
    Py_VISIT(self->done);
    Py_VISIT(self->tensor);
    Py_VISIT(self->holding);
    Py_VISIT(self->uint8);
    Py_VISIT(self->flush);
    return 0;
}

static int outlet_clear(Outlet *self) {
    Py_CLEAR(self->pipes);
    Py_CLEAR(self->limits);
    Py_CLEAR(self->strategy);
    Py_CLEAR(self->inflight);
    Py_CLEAR(self->wake);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->open);
    Py_CLEAR(self->done);
    Py_CLEAR(self->tensor);
    Py_CLEAR(self->uint8);
    Py_CLEAR(self->flush);
    Py_CLEAR(self->holding);
    return 0;
}

static void outlet_dealloc(Outlet *self) {
    PyObject_GC_UnTrack(self);
    outlet_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *const outlet_names[] = {
    "pipes", "limits", "strategy", "inflight", "wake", "failed", "open", "done", "tensor",
    "uint8", "flush", "frame_base", "hint_mask", "message_kind", "inline_max", "batch",
    "by_address", "holding"};
#define NOUTLET_NAMES ((Py_ssize_t)(sizeof outlet_names / sizeof outlet_names[0]))

/* Outlet(pipes, limits, strategy, inflight, wake, failed, open, done,
 *        tensor, uint8, flush, frame_base, hint_mask, message_kind,
 *        inline_max, batch, by_address, holding), keywords only; batch:
 *        (MAX_ITEM, MAX_MESSAGES, MAX_BYTES, BASE) of wire/batch.py, or
 *        None; by_address: (read_min, read_busy_min, read_max), or None;
 *        holding: Sender.holding. */
static PyObject *outlet_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *a[NOUTLET_NAMES];
    if (core_kwonly("Outlet", outlet_names, NOUTLET_NAMES, args, kwargs, a) < 0) return NULL;
    if (!PyDict_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "Outlet(): pipes must be a dict");
        return NULL;
    }
    if (!PyType_Check(a[8])) {
        PyErr_SetString(PyExc_TypeError, "Outlet(): tensor must be a type");
        return NULL;
    }
    uint64_t base, mask, inline_max, b[4] = {0};
    long kind = PyLong_AsLong(a[13]);
    if (as_hint(a[11], &base) < 0 || as_hint(a[12], &mask) < 0 ||
        (kind == -1 && PyErr_Occurred()) || as_hint(a[14], &inline_max) < 0)
        return NULL;
    PyObject *batch = a[15];
    if (batch != Py_None) {
        if (!PyTuple_Check(batch) || PyTuple_GET_SIZE(batch) != 4) {
            PyErr_SetString(PyExc_TypeError, "Outlet(): batch is (MAX_ITEM, MAX_MESSAGES, "
                            "MAX_BYTES, BASE) or None");
            return NULL;
        }
        for (int i = 0; i < 4; i++)
            if (as_hint(PyTuple_GET_ITEM(batch, i), &b[i]) < 0) return NULL;
    }
    uint64_t r[3] = {0};
    PyObject *reads = a[16];
    if (reads != Py_None) {
        if (!PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) != 3) {
            PyErr_SetString(PyExc_TypeError, "Outlet(): by_address is (read_min, "
                            "read_busy_min, read_max) or None");
            return NULL;
        }
        for (int i = 0; i < 3; i++)
            if (as_hint(PyTuple_GET_ITEM(reads, i), &r[i]) < 0) return NULL;
    }
    if (!PyAnySet_Check(a[17])) {
        PyErr_SetString(PyExc_TypeError, "Outlet(): holding must be a set");
        return NULL;
    }
    Outlet *self = (Outlet *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    PyObject **slots[] = {&self->pipes, &self->limits, &self->strategy, &self->inflight,
                          &self->wake, &self->failed, &self->open, &self->done,
                          &self->tensor, &self->uint8, &self->flush};
    for (int i = 0; i < 11; i++) {
        Py_INCREF(a[i]);
        *slots[i] = a[i];
    }
    self->frame_base = base;
    self->hint_mask = mask;
    self->message_kind = kind;
    self->inline_max = inline_max;
    PyObject *fm = PyObject_GetAttr(a[1], str_max_frame_bytes);
    if (!fm) {
        Py_DECREF(self);
        return NULL;
    }
    self->frame_max = PyLong_AsUnsignedLongLong(fm);
    Py_DECREF(fm);
    if (self->frame_max == (uint64_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            Py_DECREF(self);
            return NULL;
        }
        PyErr_Clear(); /* a limit of "none" */
    }
    self->batching = batch != Py_None;
    self->batch_item = b[0];
    self->batch_messages = b[1];
    self->batch_bytes = b[2];
    self->batch_base = b[3];
    self->read_min = r[0];
    self->read_busy_min = r[1];
    self->read_max = r[2];
    self->holding = Py_NewRef(a[17]);
    return (PyObject *)self;
}

static PyMethodDef outlet_methods[] = {
    {"send", (PyCFunction)(void (*)(void))outlet_send, METH_FASTCALL,
     "send(peer, hint, head, body[, buffers]) -> bool: the message as a frame alone, its "
     "buffers inline, or False (nothing changed) where it cannot go so now."},
    {"frame", (PyCFunction)(void (*)(void))outlet_frame, METH_FASTCALL,
     "frame(pipe, kind, hint, head, body): Sender._frame_alone, under the pipe's lock."},
    {"queue", (PyCFunction)(void (*)(void))outlet_queue, METH_FASTCALL,
     "queue(pipe, hint, head, body, buffers) -> bool: Sender._queue_small, under the pipe's "
     "lock."},
    {"track", (PyCFunction)(void (*)(void))outlet_track, METH_FASTCALL,
     "track(pipe, req): a frame's request watched (Sender._track's rule for its frame)."},
    {"contended", (PyCFunction)outlet_contended, METH_NOARGS,
     "contended() -> bool: whether the loop may not poll now (the strategy's blocked_until)."},
    {NULL},
};

static PyMemberDef outlet_members[] = {
    {"sent", T_ULONGLONG, offsetof(Outlet, sent), READONLY, "messages send() sent alone"},
    {"queued", T_ULONGLONG, offsetof(Outlet, queued), READONLY,
     "messages send() put in an outbox"},
    {"declined", T_ULONGLONG, offsetof(Outlet, declined), READONLY,
     "messages send() left to the Python path"},
    {"read_buffers", T_ULONGLONG, offsetof(Outlet, read_buffers), READONLY,
     "buffers send() sent by address"},
    {NULL},
};

static PyTypeObject OutletType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucxrpc._core.Outlet",
    .tp_basicsize = sizeof(Outlet),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A message without buffers or with inline ones onto its pipe in one call "
              "(transport/send.py).",
    .tp_new = outlet_new,
    .tp_dealloc = (destructor)outlet_dealloc,
    .tp_traverse = (traverseproc)outlet_traverse,
    .tp_clear = (inquiry)outlet_clear,
    .tp_methods = outlet_methods,
    .tp_members = outlet_members,
};

int core_send_init(PyObject *module) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&str_lock, "lock"}, {&str_out, "out"}, {&str_auth, "auth"}, {&str_cma, "cma"},
        {&str_ep, "ep"}, {&str_state, "state"}, {&str_outbox, "outbox"},
        {&str_last_frame, "last_frame"}, {&str_seq, "seq"},
        {&str_peer_max_frame, "peer_max_frame"}, {&str_sent, "sent"},
        {&str_out_key, "out_key"}, {&str_read_through, "read_through"},
        {&str_ack_sent, "ack_sent"}, {&str_send_frame, "send_frame"}, {&str_name, "name"},
        {&str_acquire, "acquire"}, {&str_release, "release"}, {&str_done, "done"},
        {&str_error, "error"}, {&str_blocked_until, "blocked_until"}, {&str_append, "append"},
        {&str_dtype, "dtype"}, {&str_is_cpu, "is_cpu"}, {&str_data_ptr, "data_ptr"},
        {&str_numel, "numel"}, {&str_is_contiguous, "is_contiguous"},
        {&str_outbox_bytes, "outbox_bytes"},
        {&str_max_frame_bytes, "max_frame_bytes"}, {&str_read_by_peer, "read_by_peer"},
        {&str_inbound, "inbound"}, {&str_peer_busy, "peer_busy"}, {&str_held, "held"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].text))) return -1;
    if (PyType_Ready(&OutletType) < 0) return -1;
    Py_INCREF(&OutletType);
    if (PyModule_AddObject(module, "Outlet", (PyObject *)&OutletType) < 0) {
        Py_DECREF(&OutletType);
        return -1;
    }
    return 0;
}
