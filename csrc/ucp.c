/* libucp called from C: the per-message UCX calls (send, probe, receive,
 * post a receive, cancel) and the requests they leave in flight.
 *
 * Before, these went through ctypes (a foreign call and a Python request
 * object per message, ~20 Python-level calls a round trip: Run AM).  The
 * rules they kept hold here, in C:
 *
 * - The GIL.  A thread inside a UCX call holds the worker's lock and may
 *   call back into Python (ucxx's close callback of an endpoint that
 *   failed: from UCX's progress, and from a send on that endpoint), so a
 *   thread that waits for that lock with the GIL held could deadlock.
 *   Every UCX call that takes the worker's lock (libucp's here, ucxx's
 *   through ucx_call) counts itself in `inside` while it runs, taking that
 *   count with the GIL held and giving it back before it takes the GIL
 *   again.  A call keeps the GIL only where no other thread is inside and
 *   it moves little data (HOLD_MAX): no thread can then hold the lock
 *   while wanting the GIL, and none can enter before this one lets go of
 *   it (a callback inside this one that drops the GIL leaves the count
 *   taken, so others then release it as they wait).  Elsewhere it releases
 *   the GIL as before.  Releasing it on every send was the cost: a thread
 *   that drops and retakes the GIL thousands of times a second starves one
 *   waiting for it (CPython asks the holder to drop it only after an
 *   interval with no switch, and each retake is one), so a caller's
 *   progress thread sat ~90 ms without the GIL while the caller issued
 *   rpc_async calls, its sends stuck in UCX and the callee idle
 *   (benchmarks/runs/BC.md).  ucp_request_check_status only reads the
 *   request and keeps the GIL.
 * - Ownership.  A request left in flight belongs to whoever holds its
 *   UcpRequest: only that thread looks at it, and it frees it the first time
 *   it sees it complete.  The request keeps its memory (`keep`) alive till
 *   then: UCX reads or writes it until completion.  An endpoint handle is
 *   used only while its Endpoint is open, which the pipe's lock guarantees.
 *
 * The library is the copy ucxx loaded (ucp_bind is given its path), so
 * handles ucxx made are read by the same code. */
#include "core.h"

#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <structmember.h>
#include <time.h>
#include <unistd.h>

#include "ucp_abi.h"

typedef abi_ucs_status_ptr_t (*send_nbx_t)(abi_ucp_ep_h, const void *, size_t, uint64_t,
                                           const abi_request_param_t *);
typedef abi_ucs_status_ptr_t (*tag_recv_nbx_t)(abi_ucp_worker_h, void *, size_t, uint64_t,
                                               uint64_t, const abi_request_param_t *);
typedef abi_ucp_tag_message_h (*probe_nb_t)(abi_ucp_worker_h, uint64_t, uint64_t, int,
                                            abi_tag_recv_info_t *);
typedef abi_ucs_status_ptr_t (*msg_recv_nbx_t)(abi_ucp_worker_h, void *, size_t,
                                               abi_ucp_tag_message_h,
                                               const abi_request_param_t *);
typedef abi_ucs_status_t (*check_status_t)(void *);
typedef void (*request_free_t)(void *);
typedef void (*request_cancel_t)(abi_ucp_worker_h, void *);
typedef const char *(*status_string_t)(abi_ucs_status_t);
typedef unsigned (*worker_progress_t)(abi_ucp_worker_h);

static struct {
    send_nbx_t send;
    tag_recv_nbx_t tag_recv;
    probe_nb_t probe;
    msg_recv_nbx_t msg_recv;
    check_status_t check_status;
    request_free_t free;
    request_cancel_t cancel;
    status_string_t status_string;
    worker_progress_t worker_progress;
} ucp;

/* Read-only to UCX, so shared by every thread: host memory (which spares
 * UCX a memory-type lookup per call), host I/O vectors, CUDA memory. */
static const abi_request_param_t host_param = {
    .op_attr_mask = ABI_OP_ATTR_FIELD_MEMORY_TYPE, .memory_type = ABI_MEMORY_TYPE_HOST};
static const abi_request_param_t iov_param = {
    .op_attr_mask = ABI_OP_ATTR_FIELD_MEMORY_TYPE | ABI_OP_ATTR_FIELD_DATATYPE,
    .memory_type = ABI_MEMORY_TYPE_HOST, .datatype = ABI_DATATYPE_IOV};
static const abi_request_param_t cuda_param = {
    .op_attr_mask = ABI_OP_ATTR_FIELD_MEMORY_TYPE, .memory_type = ABI_MEMORY_TYPE_CUDA};

static PyObject *failure_fn; /* failures.request_failed(detail, status) */
static PyObject *done_obj;   /* UCP_DONE: every request that completed at once */

/* Threads inside a UCX call (the GIL rule above).  Counted up with the GIL
 * held, down with or without it. */
static int inside;
/* A send or receive of at most this many bytes keeps the GIL where no other
 * thread is inside: a copy into or out of the shared-memory FIFO, or a
 * socket's buffer, of a few microseconds.  A larger one lets other threads
 * run meanwhile. */
#define HOLD_MAX (64 << 10)

static void enter(void) { __atomic_add_fetch(&inside, 1, __ATOMIC_ACQ_REL); }
static void leave(void) { __atomic_sub_fetch(&inside, 1, __ATOMIC_ACQ_REL); }
static int quiet(void) { return __atomic_load_n(&inside, __ATOMIC_ACQUIRE) == 0; }

/* Run `stmt`, a libucp call that takes the worker's lock, counted as
 * inside: with the GIL kept where `keep` and no other thread is inside,
 * else released. */
#define UCX_CALL(keep, stmt)                   \
    do {                                       \
        if ((keep) && quiet()) {               \
            enter();                           \
            stmt;                              \
            leave();                           \
        } else {                               \
            enter();                           \
            Py_BEGIN_ALLOW_THREADS stmt;       \
            leave();                           \
            Py_END_ALLOW_THREADS               \
        }                                      \
    } while (0)

/* ------------------------------------------------------------ requests */

typedef struct {
    PyObject_HEAD
    void *ptr;          /* UCX's request; NULL once freed, or if there was none */
    abi_ucs_status_t status;
    PyObject *keep;     /* the memory UCX reads or writes till completion */
} Request;

static PyTypeObject RequestType;

static PyObject *request_new(void *ptr, abi_ucs_status_t status, PyObject *keep) {
    Request *r = PyObject_GC_New(Request, &RequestType);
    if (!r) return NULL;
    r->ptr = ptr;
    r->status = status;
    Py_XINCREF(keep);
    r->keep = keep;
    PyObject_GC_Track(r);
    return (PyObject *)r;
}

/* A request's first sight of completion: its owner frees it. */
static void request_settle(Request *r, abi_ucs_status_t status) {
    void *ptr = r->ptr;
    r->ptr = NULL;
    r->status = status;
    UCX_CALL(1, ucp.free(ptr));
    Py_CLEAR(r->keep);
}

static PyObject *request_done(Request *r, void *closure) {
    if (r->status == ABI_UCS_INPROGRESS) {
        abi_ucs_status_t s = ucp.check_status(r->ptr);
        if (s == ABI_UCS_INPROGRESS) Py_RETURN_FALSE;
        request_settle(r, s);
    }
    Py_RETURN_TRUE;
}

static PyObject *failure_of(abi_ucs_status_t status) {
    const char *text = ucp.status_string ? ucp.status_string(status) : "unknown";
    return PyObject_CallFunction(failure_fn, "si", text, (int)status);
}

/* error() -> BrokenError | None: why it failed, once done. */
static PyObject *request_error(Request *r, PyObject *unused) {
    if (r->status == ABI_UCS_OK || r->status == ABI_UCS_INPROGRESS) Py_RETURN_NONE;
    return failure_of(r->status);
}

static int request_traverse(Request *r, visitproc visit, void *arg) {
    Py_VISIT(r->keep);
    return 0;
}

static int request_clear(Request *r) {
    /* A request still in flight keeps its memory: UCX may write into it.
     * Only one that ended (or never was) lets go of it here. */
    if (!r->ptr) Py_CLEAR(r->keep);
    return 0;
}

static void request_dealloc(Request *r) {
    PyObject_GC_UnTrack(r);
    if (r->ptr && r->keep) {
        /* Dropped while UCX may still use its memory (a worker parked with
         * requests posted): leak the memory rather than let UCX write into
         * freed bytes; the request itself stays UCX's. */
        r->keep = NULL;
    }
    Py_XDECREF(r->keep);
    PyObject_GC_Del(r);
}

static PyObject *request_repr(Request *r) {
    return PyUnicode_FromFormat("<UcpRequest %s status %d>", r->ptr ? "in flight" : "ended",
                                (int)r->status);
}

static PyGetSetDef request_getset[] = {
    {"done", (getter)request_done, NULL,
     "Whether UCX completed it (the first True frees it and lets go of its memory).", NULL},
    {NULL}};

static PyMemberDef request_members[] = {
    {"keep", T_OBJECT, offsetof(Request, keep), 0, "the memory held for UCX till completion"},
    {NULL}};

static PyMethodDef request_methods[] = {
    {"error", (PyCFunction)request_error, METH_NOARGS,
     "error() -> BrokenError | None: why it failed (once done), else None."},
    {NULL}};

static PyTypeObject RequestType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ucxrpc._core.UcpRequest",
    .tp_basicsize = sizeof(Request),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A send or receive UCX left in flight, looked at by its owner only.",
    .tp_traverse = (traverseproc)request_traverse,
    .tp_clear = (inquiry)request_clear,
    .tp_dealloc = (destructor)request_dealloc,
    .tp_repr = (reprfunc)request_repr,
    .tp_getset = request_getset,
    .tp_members = request_members,
    .tp_methods = request_methods,
};

/* What a call's status pointer becomes: the shared done object, a request
 * that failed at once, or one in flight holding `keep`. */
static PyObject *outcome(abi_ucs_status_ptr_t p, PyObject *keep) {
    if (p == NULL) {
        Py_INCREF(done_obj);
        return done_obj;
    }
    if (abi_ptr_is_err(p)) return request_new(NULL, abi_ptr_status(p), NULL);
    PyObject *r = request_new(p, ABI_UCS_INPROGRESS, keep);
    if (!r) {
        /* UCX goes on with it; the memory must outlive it. */
        Py_XINCREF(keep);
    }
    return r;
}

/* ------------------------------------------------------------ arguments */

static int ready(void) {
    if (!ucp.send) {
        PyErr_SetString(PyExc_RuntimeError, "ucxrpc._core.ucp_bind() was not called");
        return 0;
    }
    return 1;
}

static int as_ptr(PyObject *o, void **out) {
    *out = PyLong_AsVoidPtr(o);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* A host buffer's address and length; the object itself keeps it alive. */
static int host_span(PyObject *buf, int writable, void **addr, size_t *len) {
    Py_buffer b;
    if (PyObject_GetBuffer(buf, &b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    *addr = b.buf;
    *len = (size_t)b.len;
    PyBuffer_Release(&b);
    return 0;
}

#define NARGS(name, n)                                                        \
    if (nargs != (n)) {                                                       \
        PyErr_Format(PyExc_TypeError, name "() takes %d arguments", (int)(n)); \
        return NULL;                                                          \
    }

/* ------------------------------------------------------------ calls */

#define FULL_MASK UINT64_MAX

/* What a call posts: a send (tag_send) or a receive of exactly one tag,
 * of host memory, an I/O vector of host memory, or CUDA memory. */
typedef enum { SEND, SEND_IOV, SEND_DEVICE, RECV, RECV_DEVICE } op_t;

static abi_ucs_status_ptr_t post_call(op_t op, void *h, void *addr, size_t len, uint64_t tag) {
    switch (op) {
    case SEND: return ucp.send(h, addr, len, tag, &host_param);
    case SEND_IOV: return ucp.send(h, addr, len / sizeof(abi_dt_iov_t), tag, &iov_param);
    case SEND_DEVICE: return ucp.send(h, addr, len, tag, &cuda_param);
    case RECV: return ucp.tag_recv(h, addr, len, tag, FULL_MASK, &host_param);
    default: return ucp.tag_recv(h, addr, len, tag, FULL_MASK, &cuda_param);
    }
}

/* Post `op` on handle `h` (an endpoint for sends, a worker for receives;
 * the call takes the worker's lock: a small host send or receive keeps the
 * GIL where it may, the rest release it); the request holds `keep`. */
static PyObject *post(op_t op, void *h, void *addr, size_t len, uint64_t tag, PyObject *keep) {
    abi_ucs_status_ptr_t p;
    UCX_CALL((op == SEND || op == RECV) && len <= HOLD_MAX,
             p = post_call(op, h, addr, len, tag));
    return outcome(p, keep);
}

/* (handle, host buffer, tag[, keep]): the buffer's own object is kept
 * unless a `keep` is given. */
static PyObject *post_host(op_t op, const char *name, PyObject *const *args, Py_ssize_t nargs,
                           Py_ssize_t want) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments", name, want);
        return NULL;
    }
    void *h, *addr;
    size_t len;
    uint64_t tag;
    if (!ready() || as_ptr(args[0], &h) < 0 ||
        host_span(args[1], op == RECV, &addr, &len) < 0 || as_u64(args[2], &tag) < 0)
        return NULL;
    return post(op, h, addr, len, tag, want == 4 ? args[3] : args[1]);
}

/* (handle, device address, nbytes, tag, keep). */
static PyObject *post_device(op_t op, const char *name, PyObject *const *args,
                             Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "%s() takes 5 arguments", name);
        return NULL;
    }
    void *h, *addr;
    uint64_t n, tag;
    if (!ready() || as_ptr(args[0], &h) < 0 || as_ptr(args[1], &addr) < 0 ||
        as_u64(args[2], &n) < 0 || as_u64(args[3], &tag) < 0)
        return NULL;
    return post(op, h, addr, (size_t)n, tag, args[4]);
}

/* ucp_send(ep, buf, tag): send host array `buf`. */
static PyObject *py_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return post_host(SEND, "ucp_send", args, nargs, 3);
}

/* ucp_send_iov(ep, iov, tag, keep): send the host memory `iov` lists
 * ((address, length) pairs, uint64) as one message; `keep` holds that
 * memory and `iov` until UCX is done with them. */
static PyObject *py_send_iov(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return post_host(SEND_IOV, "ucp_send_iov", args, nargs, 4);
}

/* ucp_send_device(ep, address, nbytes, tag, keep): CUDA memory. */
static PyObject *py_send_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return post_device(SEND_DEVICE, "ucp_send_device", args, nargs);
}

/* ucp_tag_recv(worker, buf, tag): post a receive of the message with
 * exactly `tag` into writable host array `buf` (a longer message fails the
 * request: truncated). */
static PyObject *py_tag_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return post_host(RECV, "ucp_tag_recv", args, nargs, 3);
}

/* ucp_tag_recv_device(worker, address, nbytes, tag, keep): into CUDA memory. */
static PyObject *py_tag_recv_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return post_device(RECV_DEVICE, "ucp_tag_recv_device", args, nargs);
}

/* (worker, tag, mask) from three arguments in a row: what probing takes. */
static int worker_match(PyObject *const *args, void **worker, uint64_t *tag, uint64_t *mask) {
    if (!ready() || as_ptr(args[0], worker) < 0 || as_u64(args[1], tag) < 0 ||
        as_u64(args[2], mask) < 0)
        return -1;
    return 0;
}

/* The next message matching tag/mask taken off the unexpected queue (the
 * GIL released: the call takes the worker's lock), or NULL. */
static abi_ucp_tag_message_h take_one(void *worker, uint64_t tag, uint64_t mask,
                                      abi_tag_recv_info_t *info) {
    abi_ucp_tag_message_h msg;
    UCX_CALL(1, msg = ucp.probe(worker, tag, mask, 1, info));
    return msg;
}

/* ucp_probe(worker, tag, mask) -> (sender tag, length, message handle) of a
 * message taken off the worker's unexpected queue, or None. */
static PyObject *py_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("ucp_probe", 3);
    void *worker;
    uint64_t tag, mask;
    if (worker_match(args, &worker, &tag, &mask) < 0) return NULL;
    abi_tag_recv_info_t info;
    abi_ucp_tag_message_h msg = take_one(worker, tag, mask, &info);
    if (!msg) Py_RETURN_NONE;
    return Py_BuildValue("(KnN)", (unsigned long long)info.sender_tag, (Py_ssize_t)info.length,
                         PyLong_FromVoidPtr(msg));
}

/* ucp_receive(worker, buf, msg): receive probed message `msg` into
 * writable host array `buf` (a shorter buffer truncates it: the request
 * fails, the data is gone). */
static PyObject *py_receive(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("ucp_receive", 3);
    void *worker, *addr, *msg;
    size_t len;
    if (!ready() || as_ptr(args[0], &worker) < 0 || host_span(args[1], 1, &addr, &len) < 0 ||
        as_ptr(args[2], &msg) < 0)
        return NULL;
    abi_ucs_status_ptr_t p;
    UCX_CALL(len <= HOLD_MAX, p = ucp.msg_recv(worker, addr, len, msg, &host_param));
    return outcome(p, args[1]);
}

/* ucp_take(worker, tag, mask, small, alloc) -> list or None: every message
 * matching tag/mask taken off the unexpected queue, in the order UCX gives
 * them, as (sender tag, length, request, buffer).  One of at most `small`
 * bytes is received at once into `alloc(length)` (a writable host buffer;
 * the request holds it): it is already in UCX's memory, so receiving it
 * costs no more than leaving it there.  A larger one comes as (sender tag,
 * length, None, message handle), for the caller to judge before a byte of
 * it is read (ucp_receive).  None where nothing matched.  One call for a
 * turn's frames: probing and receiving each in Python cost ~6 calls a
 * frame (Run AN). */
/* A message taken off the queue that cannot be received as meant (an
 * error on the way): received into one byte, truncated, so that UCX lets
 * go of it; a request still in flight then is UCX's, never freed (a leak
 * on an error path, not a write into freed memory). */
static void drop_taken(void *worker, abi_ucp_tag_message_h msg) {
    static char sink;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    UCX_CALL(1, ucp.msg_recv(worker, &sink, 1, msg, &host_param));
    PyErr_Restore(type, value, tb);
}

/* ucp_take's work, for it and for ucp_spin: a new list, None, or NULL
 * with an exception set. */
static PyObject *take_all(void *worker, uint64_t tag, uint64_t mask, Py_ssize_t small,
                          PyObject *alloc) {
    PyObject *out = NULL;
    for (;;) {
        abi_tag_recv_info_t info;
        abi_ucp_tag_message_h msg = take_one(worker, tag, mask, &info);
        if (!msg) break;
        PyObject *item = NULL;
        Py_ssize_t length = (Py_ssize_t)info.length;
        if (!out && !(out = PyList_New(0))) {
            drop_taken(worker, msg);
            return NULL;
        }
        if (length <= small) {
            PyObject *n = PyLong_FromSsize_t(length);
            PyObject *buf = n ? PyObject_CallOneArg(alloc, n) : NULL;
            Py_XDECREF(n);
            void *addr = NULL;
            size_t len = 0;
            if (buf && (host_span(buf, 1, &addr, &len) < 0 || len < (size_t)length)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "ucp_take: alloc gave a short buffer");
                Py_CLEAR(buf);
            }
            if (!buf) {
                drop_taken(worker, msg);
                Py_DECREF(out);
                return NULL;
            }
            abi_ucs_status_ptr_t p;
            UCX_CALL(length <= HOLD_MAX,
                        p = ucp.msg_recv(worker, addr, (size_t)length, msg, &host_param));
            PyObject *req = outcome(p, buf); /* from here the request holds buf */
            if (req) item = Py_BuildValue("(KnNN)", (unsigned long long)info.sender_tag, length,
                                          req, buf);
            else Py_DECREF(buf);
        } else {
            PyObject *handle = PyLong_FromVoidPtr(msg);
            if (!handle) {
                drop_taken(worker, msg);
                Py_DECREF(out);
                return NULL;
            }
            item = Py_BuildValue("(KnON)", (unsigned long long)info.sender_tag, length, Py_None,
                                 handle);
        }
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    if (!out) Py_RETURN_NONE;
    return out;
}

/* (worker, tag, mask, small) from four arguments in a row: what taking
 * takes (ucp_take, ucp_spin); the allocator follows them. */
static int take_args(PyObject *const *args, void **worker, uint64_t *tag, uint64_t *mask,
                     Py_ssize_t *small) {
    if (worker_match(args, worker, tag, mask) < 0) return -1;
    *small = PyLong_AsSsize_t(args[3]);
    return *small == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *py_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("ucp_take", 5);
    void *worker;
    uint64_t tag, mask;
    Py_ssize_t small;
    if (take_args(args, &worker, &tag, &mask, &small) < 0) return NULL;
    return take_all(worker, tag, mask, small, args[4]);
}

/* ucp_cancel(worker, req): cancel a receive still in flight, by its owner;
 * UCX completes it with UCS_ERR_CANCELED, and the owner frees it when it
 * sees that.  Returns 1 if it was in flight, else 0. */
static PyObject *py_cancel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("ucp_cancel", 2);
    void *worker;
    if (!ready() || as_ptr(args[0], &worker) < 0) return NULL;
    if (Py_TYPE(args[1]) != &RequestType) return PyLong_FromLong(0);
    Request *r = (Request *)args[1];
    if (!r->ptr || r->status != ABI_UCS_INPROGRESS) return PyLong_FromLong(0);
    void *ptr = r->ptr;
    UCX_CALL(1, ucp.cancel(worker, ptr));
    return PyLong_FromLong(1);
}

/* ------------------------------------------------------------ the quiet spin */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

enum { SPIN_FRAME = 0, SPIN_LATE = 1, SPIN_BUDGET = 2, SPIN_WOKEN = 3 };

/* ucp_spin(worker, tag, mask, small, alloc, wake_fd, budget_s, late_s)
 *   -> (why, quick yields, the late yield's seconds, frames taken or None)
 *
 * What the progress loop's idle turns do while a message is awaited and
 * nothing else is in flight, without a Python call per turn: UCX progress,
 * a look for a frame matching tag/mask, a look at the loop's wake
 * descriptor, and the CPU given up (timed) for whoever wants it.  The
 * frames it finds are taken as ucp_take takes them (small, alloc) and
 * returned, for the caller to hand on at once: left for the loop's next
 * turn, each cost a turn (a Python call for the done() test, ucxx's
 * progress, the turn, the receiver's poll) on both sides of every call
 * (Run AU).  It returns when a frame waits (0), when
 * a yield came back after `late_s` (1: another thread or process wants this
 * core; the strategy decides), when `budget_s` ran out (2), or when someone
 * woke the loop (3: the wake-up is consumed, as the loop's own sleep
 * consumes it).  Measured in Run AM: an idle turn cost ~23 Python calls.
 *
 * The progress is libucp's own, not ucxx's `Worker.progress`, so a round
 * holds the GIL not at all (one release for the whole round, not one for
 * ucxx's call and one for the rest): ucxx's adds only its delayed
 * submissions (ucxrpc makes none) and the requests of its own it was asked
 * to cancel, under a mutex and a hash table's clear every call (Run AP:
 * 2.2% of a no-op's samples, its mutex besides).  The loop's turns call
 * libucp's too (ucp_progress); ucxx's runs each time the loop goes idle
 * (binding.py's Worker.arm).  A callback UCX runs from its progress (an
 * endpoint's error callback into ucxx) takes the GIL itself, as it does on
 * ucxx's progress thread: the round is counted as inside (the GIL rule). */
static PyObject *py_spin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("ucp_spin", 8);
    void *worker;
    uint64_t tag, mask;
    Py_ssize_t small;
    if (take_args(args, &worker, &tag, &mask, &small) < 0) return NULL;
    PyObject *alloc = args[4];
    int fd = (int)PyLong_AsLong(args[5]);
    double budget = PyFloat_AsDouble(args[6]), late = PyFloat_AsDouble(args[7]);
    if (PyErr_Occurred()) return NULL;
    double start = now_s(), took = 0.0;
    long quick = 0;
    int why = SPIN_BUDGET;
    for (;;) {
        int found = 0, woken = 0, spent = 0;
        enter(); /* the GIL rule: counted before the GIL goes, */
        Py_BEGIN_ALLOW_THREADS
        abi_tag_recv_info_t info;
        ucp.worker_progress(worker);
        found = ucp.probe(worker, tag, mask, 0, &info) != NULL;
        leave(); /* and given back before it is taken again */
        if (!found) {
            uint64_t v;
            woken = read(fd, &v, sizeof v) == (ssize_t)sizeof v;
            if (!woken) {
                /* Two clock reads a turn: the one before the yield also
                 * decides the budget (a spent budget gives up no CPU). */
                double y = now_s();
                spent = y - start >= budget;
                if (!spent) {
                    sched_yield();
                    took = now_s() - y;
                }
            }
        }
        Py_END_ALLOW_THREADS
        if (found) {
            why = SPIN_FRAME;
            break;
        }
        if (woken) {
            why = SPIN_WOKEN;
            break;
        }
        if (spent) {
            why = SPIN_BUDGET;
            break;
        }
        if (took > late) {
            why = SPIN_LATE;
            break;
        }
        quick++;
        took = 0.0;
    }
    PyObject *taken = Py_None;
    Py_INCREF(taken);
    if (why == SPIN_FRAME) {
        Py_DECREF(taken);
        if (!(taken = take_all(worker, tag, mask, small, alloc))) return NULL;
    }
    return Py_BuildValue("(ildN)", why, quick, why == SPIN_LATE ? took : 0.0, taken);
}

/* ucp_progress(worker) -> events: UCX's progress, libucp's own (as the
 * spin's: ucxx's adds only its own bookkeeping, which the loop runs when it
 * goes idle, through ucx_call), counted as inside, the GIL released. */
static PyObject *py_progress(PyObject *self, PyObject *arg) {
    void *worker;
    if (!ready() || as_ptr(arg, &worker) < 0) return NULL;
    unsigned n;
    UCX_CALL(0, n = ucp.worker_progress(worker));
    return PyLong_FromUnsignedLong(n);
}

/* ucx_call(fn, *args) -> fn(*args), counted as inside UCX (the GIL rule):
 * for ucxx's calls (its progress, creating, closing and arming, its
 * sends).  ucxx retakes the GIL before this gives the count back:
 * meanwhile other threads release the GIL around their UCX calls, as they
 * always did. */
static PyObject *py_ucx_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "ucx_call() takes the function to call");
        return NULL;
    }
    enter();
    PyObject *r = PyObject_Vectorcall(args[0], args + 1, (size_t)(nargs - 1), NULL);
    leave();
    return r;
}

/* ucx_inside() -> how many threads are inside a UCX call (diagnostics and
 * tests). */
static PyObject *py_ucx_inside(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(__atomic_load_n(&inside, __ATOMIC_ACQUIRE));
}

static void *symbol(void *lib, const char *name, const char *path) {
    void *p = dlsym(lib, name);
    if (!p) PyErr_Format(PyExc_ImportError, "%s has no %s: not a UCX 1.x libucp", path, name);
    return p;
}

/* ucp_bind(libucp path, libucs path, request_failed): open the UCX
 * copy ucxx loaded and take the calls; once per process (a second call with
 * the same libraries changes nothing). */
static PyObject *py_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("ucp_bind", 3);
    const char *ucp_path = PyUnicode_AsUTF8(args[0]);
    const char *ucs_path = ucp_path ? PyUnicode_AsUTF8(args[1]) : NULL;
    if (!ucs_path) return NULL;
    if (!PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "request_failed must be callable");
        return NULL;
    }
    /* Never closed: UCX stays loaded for the life of the process anyway. */
    void *lib = dlopen(ucp_path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        PyErr_Format(PyExc_ImportError, "cannot load libucp: %s", dlerror());
        return NULL;
    }
    void *lib_ucs = dlopen(ucs_path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib_ucs) {
        PyErr_Format(PyExc_ImportError, "cannot load libucs: %s", dlerror());
        return NULL;
    }
    void *f[9];
    static const char *const names[8] = {"ucp_tag_send_nbx", "ucp_tag_recv_nbx", "ucp_tag_probe_nb",
                                         "ucp_tag_msg_recv_nbx", "ucp_request_check_status",
                                         "ucp_request_free", "ucp_request_cancel",
                                         "ucp_worker_progress"};
    for (int i = 0; i < 8; i++)
        if (!(f[i] = symbol(lib, names[i], ucp_path))) return NULL;
    if (!(f[8] = symbol(lib_ucs, "ucs_status_string", ucs_path))) return NULL;
    ucp.send = (send_nbx_t)f[0];
    ucp.tag_recv = (tag_recv_nbx_t)f[1];
    ucp.probe = (probe_nb_t)f[2];
    ucp.msg_recv = (msg_recv_nbx_t)f[3];
    ucp.check_status = (check_status_t)f[4];
    ucp.free = (request_free_t)f[5];
    ucp.cancel = (request_cancel_t)f[6];
    ucp.worker_progress = (worker_progress_t)f[7];
    ucp.status_string = (status_string_t)f[8];
    Py_INCREF(args[2]);
    Py_XSETREF(failure_fn, args[2]);
    Py_RETURN_NONE;
}

/* ucp_abi() -> {name: value}: the offsets, sizes and constants ucp_abi.h
 * declares, for the test that holds them against UCX's headers. */
static PyObject *py_abi(PyObject *self, PyObject *unused) {
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:i,s:i,s:i,s:i,s:i,s:i}",
        "sizeof(ucp_request_param_t)", (Py_ssize_t)sizeof(abi_request_param_t),
        "op_attr_mask", (Py_ssize_t)offsetof(abi_request_param_t, op_attr_mask),
        "flags", (Py_ssize_t)offsetof(abi_request_param_t, flags),
        "request", (Py_ssize_t)offsetof(abi_request_param_t, request),
        "cb", (Py_ssize_t)offsetof(abi_request_param_t, cb),
        "datatype", (Py_ssize_t)offsetof(abi_request_param_t, datatype),
        "user_data", (Py_ssize_t)offsetof(abi_request_param_t, user_data),
        "reply_buffer", (Py_ssize_t)offsetof(abi_request_param_t, reply_buffer),
        "memory_type", (Py_ssize_t)offsetof(abi_request_param_t, memory_type),
        "recv_info", (Py_ssize_t)offsetof(abi_request_param_t, recv_info),
        "memh", (Py_ssize_t)offsetof(abi_request_param_t, memh),
        "sizeof(ucp_tag_recv_info_t)", (Py_ssize_t)sizeof(abi_tag_recv_info_t),
        "sender_tag", (Py_ssize_t)offsetof(abi_tag_recv_info_t, sender_tag),
        "length", (Py_ssize_t)offsetof(abi_tag_recv_info_t, length),
        "sizeof(ucp_dt_iov_t)", (Py_ssize_t)sizeof(abi_dt_iov_t),
        "UCP_OP_ATTR_FIELD_DATATYPE", (int)ABI_OP_ATTR_FIELD_DATATYPE,
        "UCP_OP_ATTR_FIELD_MEMORY_TYPE", (int)ABI_OP_ATTR_FIELD_MEMORY_TYPE,
        "UCS_MEMORY_TYPE_HOST", ABI_MEMORY_TYPE_HOST,
        "UCS_MEMORY_TYPE_CUDA", ABI_MEMORY_TYPE_CUDA,
        "UCP_DATATYPE_IOV", ABI_DATATYPE_IOV,
        "UCS_ERR_LAST", ABI_UCS_ERR_LAST);
}

PyMethodDef core_ucp_methods[] = {
    {"ucp_bind", (PyCFunction)(void (*)(void))py_bind, METH_FASTCALL,
     "ucp_bind(libucp_path, libucs_path, request_failed)"},
    {"ucp_send", (PyCFunction)(void (*)(void))py_send, METH_FASTCALL,
     "ucp_send(ep, buf, tag) -> request: send host array buf."},
    {"ucp_send_iov", (PyCFunction)(void (*)(void))py_send_iov, METH_FASTCALL,
     "ucp_send_iov(ep, iov, tag, keep) -> request: the memory iov lists, as one message."},
    {"ucp_send_device", (PyCFunction)(void (*)(void))py_send_device, METH_FASTCALL,
     "ucp_send_device(ep, address, nbytes, tag, keep) -> request: CUDA memory."},
    {"ucp_tag_recv", (PyCFunction)(void (*)(void))py_tag_recv, METH_FASTCALL,
     "ucp_tag_recv(worker, buf, tag) -> request: post a receive into host array buf."},
    {"ucp_tag_recv_device", (PyCFunction)(void (*)(void))py_tag_recv_device, METH_FASTCALL,
     "ucp_tag_recv_device(worker, address, nbytes, tag, keep) -> request: into CUDA memory."},
    {"ucp_probe", (PyCFunction)(void (*)(void))py_probe, METH_FASTCALL,
     "ucp_probe(worker, tag, mask) -> (sender_tag, length, message) or None."},
    {"ucp_receive", (PyCFunction)(void (*)(void))py_receive, METH_FASTCALL,
     "ucp_receive(worker, buf, message) -> request: receive a probed message."},
    {"ucp_take", (PyCFunction)(void (*)(void))py_take, METH_FASTCALL,
     "ucp_take(worker, tag, mask, small, alloc) -> [(sender_tag, length, request or None, "
     "buffer or message)] or None: a turn's messages, the small ones received."},
    {"ucp_cancel", (PyCFunction)(void (*)(void))py_cancel, METH_FASTCALL,
     "ucp_cancel(worker, request) -> 1 if it was in flight, else 0."},
    {"ucp_spin", (PyCFunction)(void (*)(void))py_spin, METH_FASTCALL,
     "ucp_spin(worker, tag, mask, small, alloc, wake_fd, budget_s, late_s) -> (why, "
     "quick yields, late seconds, frames taken or None): idle turns without Python; "
     "why: 0 frames (taken as ucp_take takes them), 1 late yield, 2 budget spent, "
     "3 woken."},
    {"ucp_progress", (PyCFunction)py_progress, METH_O,
     "ucp_progress(worker) -> events: libucp's progress, counted as inside UCX."},
    {"ucx_call", (PyCFunction)(void (*)(void))py_ucx_call, METH_FASTCALL,
     "ucx_call(fn, *args) -> fn(*args), counted as inside UCX (a call into ucxx)."},
    {"ucx_inside", (PyCFunction)py_ucx_inside, METH_NOARGS,
     "ucx_inside() -> threads inside a UCX call."},
    {"ucp_abi", (PyCFunction)py_abi, METH_NOARGS,
     "ucp_abi() -> the offsets, sizes and constants the core assumes of libucp."},
    {NULL, NULL, 0, NULL}};

int core_ucp_init(PyObject *module) {
    if (PyType_Ready(&RequestType) < 0) return -1;
    Py_INCREF(&RequestType);
    if (PyModule_AddObject(module, "UcpRequest", (PyObject *)&RequestType) < 0) {
        Py_DECREF(&RequestType);
        return -1;
    }
    /* One object for every request UCX completed when it was made (most
     * sends of a small frame): nothing to free, nothing failed. */
    done_obj = request_new(NULL, ABI_UCS_OK, NULL);
    if (!done_obj) return -1;
    Py_INCREF(done_obj);
    if (PyModule_AddObject(module, "UCP_DONE", done_obj) < 0) {
        Py_DECREF(done_obj);
        return -1;
    }
    return 0;
}
