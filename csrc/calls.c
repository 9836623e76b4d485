/* The table of calls a worker made and waits for (agent/calls.py's
 * CallTable keeps its policy: completing futures, the timer thread, the
 * callback pool): futures by message id, message ids by peer, and the
 * deadlines, one FIFO per timeout value (sorted for free: a deadline is
 * its call's start plus that FIFO's timeout).
 *
 * Every rpc_sync and rpc_async adds a call, and every reply takes one out.
 * In Python that was three dicts and a set under a lock, and a deque
 * under a Condition for the deadline: ~20 Python and C calls and 1.8 µs a
 * call in a loop, several times that just after a large transfer (issue
 * 52; benchmarks/runs/AT.md).  Here each is one C call.
 *
 * No lock: every method holds the GIL throughout and runs no Python code.
 * A collection (and the finalizers it may run, which may switch threads)
 * can start only where a GC-tracked object is allocated, so each method
 * allocates such objects before it changes the table or after, never in
 * between: another thread never sees half a change, and a call is taken
 * out by one thread only. */
#include "core.h"

#include <structmember.h>

typedef struct {
    double deadline;
    long long id;
} Entry;

typedef struct {
    double timeout;
    Entry *items; /* live entries: items[head .. len) */
    Py_ssize_t head, len, cap;
} Fifo;

typedef struct {
    PyObject_HEAD
    PyObject *by_id;   /* msg_id -> future */
    PyObject *meta;    /* msg_id -> peer << 1 | waited */
    PyObject *by_peer; /* peer -> set of msg_ids */
    PyTypeObject *call_type;
    Fifo *fifos;
    int nfifos;
} Calls;

static int calls_traverse(Calls *self, visitproc visit, void *arg) {
    Py_VISIT(self->by_id);
    Py_VISIT(self->meta);
    Py_VISIT(self->by_peer);
    Py_VISIT(self->call_type);
    return 0;
}

static int calls_clear(Calls *self) {
    Py_CLEAR(self->by_id);
    Py_CLEAR(self->meta);
    Py_CLEAR(self->by_peer);
    Py_CLEAR(self->call_type);
    return 0;
}

static void calls_dealloc(Calls *self) {
    PyObject_GC_UnTrack(self);
    calls_clear(self);
    for (int i = 0; i < self->nfifos; i++) PyMem_Free(self->fifos[i].items);
    PyMem_Free(self->fifos);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Calls(call_type): call_type, the tuple subclass pop() returns, of three
 * items (future, peer, waited): agent/calls.py's Call. */
static PyObject *calls_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *call_type;
    if (!PyArg_ParseTuple(args, "O!:Calls", &PyType_Type, &call_type)) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)call_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "Calls(): call_type must be a tuple subclass");
        return NULL;
    }
    Calls *self = (Calls *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->by_id = PyDict_New();
    self->meta = PyDict_New();
    self->by_peer = PyDict_New();
    if (!self->by_id || !self->meta || !self->by_peer) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(call_type);
    self->call_type = (PyTypeObject *)call_type;
    return (PyObject *)self;
}

static Fifo *fifo_for(Calls *self, double timeout) {
    for (int i = 0; i < self->nfifos; i++)
        if (self->fifos[i].timeout == timeout) return &self->fifos[i];
    Fifo *more = PyMem_Realloc(self->fifos, sizeof(Fifo) * (self->nfifos + 1));
    if (!more) return (Fifo *)PyErr_NoMemory();
    self->fifos = more;
    Fifo *f = &self->fifos[self->nfifos++];
    f->timeout = timeout;
    f->items = NULL;
    f->head = f->len = f->cap = 0;
    return f;
}

/* A call's timeout in seconds, checked: 0, or -1 with ValueError set. */
static int timeout_of(PyObject *timeout, double *t) {
    *t = PyFloat_AsDouble(timeout);
    if (*t == -1.0 && PyErr_Occurred()) return -1;
    if (!(*t >= 0.0)) { /* also NaN */
        PyErr_Format(PyExc_ValueError, "a call's timeout must be >= 0, not %R", timeout);
        return -1;
    }
    return 0;
}

/* Queue a deadline; 1 when its FIFO was empty (the timer thread, which
 * may wait up to a second with nothing queued, is to be told), 0 if not,
 * -1 on error. */
static int push_deadline(Calls *self, long long id, double t) {
    Fifo *f = fifo_for(self, t);
    if (!f) return -1;
    if (f->len == f->cap) {
        if (f->head > 0) { /* room at the front: slide down first */
            memmove(f->items, f->items + f->head, sizeof(Entry) * (f->len - f->head));
            f->len -= f->head;
            f->head = 0;
        }
        if (f->len == f->cap) {
            Py_ssize_t cap = f->cap ? f->cap * 2 : 64;
            Entry *items = PyMem_Realloc(f->items, sizeof(Entry) * cap);
            if (!items) {
                PyErr_NoMemory();
                return -1;
            }
            f->items = items;
            f->cap = cap;
        }
    }
    int was_empty = f->len == f->head;
    f->items[f->len].deadline = core_monotonic() + t;
    f->items[f->len].id = id;
    f->len++;
    return was_empty;
}

/* add(msg_id, future, peer, waited, timeout) -> bool: the call is in the
 * table, with its deadline where timeout is not None; True when the timer
 * thread is to be told (push_deadline). */
static PyObject *calls_add(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add() takes 5 arguments");
        return NULL;
    }
    PyObject *key = args[0], *future = args[1], *peer = args[2], *timeout = args[4];
    long long id = PyLong_AsLongLong(key);
    long long p = PyLong_AsLongLong(peer);
    if (PyErr_Occurred()) return NULL;
    int waited = PyObject_IsTrue(args[3]);
    if (waited < 0) return NULL;
    /* The timeout checked before anything goes in: a refused one leaves no
     * call behind that nobody would take out. */
    double t = 0.0;
    if (timeout != Py_None && timeout_of(timeout, &t) < 0) return NULL;
    /* What may start a collection first (see the top): the peer's set. */
    PyObject *set = PyDict_GetItemWithError(self->by_peer, peer);
    if (!set) {
        if (PyErr_Occurred()) return NULL;
        PyObject *fresh = PySet_New(NULL);
        if (!fresh) return NULL;
        /* A collection in PySet_New may have run code that made the peer's
         * set meanwhile: read it again before putting in ours. */
        set = PyDict_GetItemWithError(self->by_peer, peer);
        if (!set && !PyErr_Occurred()) {
            if (PyDict_SetItem(self->by_peer, peer, fresh) == 0) set = fresh;
        }
        Py_DECREF(fresh); /* the dict holds the one in use */
        if (!set) return NULL;
    }
    PyObject *meta = PyLong_FromLongLong(p << 1 | waited); /* an int: not tracked */
    if (!meta) return NULL;
    int rc = PyDict_SetItem(self->by_id, key, future);
    if (rc == 0) rc = PyDict_SetItem(self->meta, key, meta);
    if (rc == 0) rc = PySet_Add(set, key);
    Py_DECREF(meta);
    if (rc < 0) return NULL;
    if (timeout == Py_None) Py_RETURN_FALSE;
    int tell = push_deadline(self, id, t);
    if (tell < 0) return NULL;
    return PyBool_FromLong(tell);
}

/* arm(msg_id, timeout) -> bool: a deadline for a call already added. */
static PyObject *calls_arm(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "arm() takes 2 arguments");
        return NULL;
    }
    long long id = PyLong_AsLongLong(args[0]);
    if (id == -1 && PyErr_Occurred()) return NULL;
    double t;
    if (timeout_of(args[1], &t) < 0) return NULL;
    int tell = push_deadline(self, id, t);
    if (tell < 0) return NULL;
    return PyBool_FromLong(tell);
}

/* pop(msg_id) -> Call | None: the call taken out, or None where it was
 * answered, failed or timed out already. */
static PyObject *calls_pop(Calls *self, PyObject *key) {
    /* The Call first (it may start a collection), then the table's change
     * with nothing allocated in between. */
    PyObject *call = self->call_type->tp_alloc(self->call_type, 3);
    if (!call) return NULL;
    PyObject *future = PyDict_GetItemWithError(self->by_id, key);
    if (!future) {
        Py_DECREF(call);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(future);
    PyObject *m = PyDict_GetItemWithError(self->meta, key);
    long long meta = m ? PyLong_AsLongLong(m) : 0;
    /* (an int: not tracked, so made here; failing, nothing has changed) */
    PyObject *peer_obj = PyLong_FromLongLong(meta >> 1);
    if (!peer_obj || PyDict_DelItem(self->by_id, key) < 0 ||
        (m && PyDict_DelItem(self->meta, key) < 0)) {
        Py_XDECREF(peer_obj);
        Py_DECREF(future);
        Py_DECREF(call);
        return NULL;
    }
    PyObject *set = PyDict_GetItemWithError(self->by_peer, peer_obj);
    if (set && PySet_Discard(set, key) < 0) PyErr_Clear(); /* an int key: cannot fail */
    PyTuple_SET_ITEM(call, 0, future);
    PyTuple_SET_ITEM(call, 1, peer_obj);
    PyTuple_SET_ITEM(call, 2, PyBool_FromLong((long)(meta & 1)));
    return call;
}

/* take_peer(peer) -> list: the message ids of the calls waiting on peer,
 * whose set is dropped (the caller fails each by pop). */
static PyObject *calls_take_peer(Calls *self, PyObject *peer) {
    PyObject *set = PyDict_GetItemWithError(self->by_peer, peer);
    if (!set) {
        if (PyErr_Occurred()) return NULL;
        return PyList_New(0);
    }
    Py_INCREF(set);
    if (PyDict_DelItem(self->by_peer, peer) < 0) {
        Py_DECREF(set);
        return NULL;
    }
    PyObject *ids = PySequence_List(set);
    Py_DECREF(set);
    return ids;
}

static int is_live(Calls *self, long long id) {
    PyObject *key = PyLong_FromLongLong(id); /* an int: not tracked */
    if (!key) return -1;
    int live = PyDict_Contains(self->by_id, key);
    Py_DECREF(key);
    return live;
}

/* expire(now) -> (expired, wait): the (msg_id, timeout) of the calls whose
 * deadline passed and that are still in the table; answered calls'
 * entries at a FIFO's head dropped on the way, and a FIFO holding far more
 * entries than calls are in the table (answered ones queued behind a slow
 * one) rebuilt without them.  wait: seconds until the next deadline, at
 * most 0.1 while any entry is queued (answered ones go soon too); None
 * when none is: the caller waits until add() or arm() says a deadline went
 * into an empty FIFO (an idle worker's timer thread then never wakes). */
static PyObject *calls_expire(Calls *self, PyObject *now_obj) {
    double now = PyFloat_AsDouble(now_obj);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t calls = PyDict_GET_SIZE(self->by_id);
    /* Found with no object allocated but ints (no collection, so no other
     * thread meanwhile); the result built after. */
    Py_ssize_t nfound = 0, room = 0;
    Entry *found = NULL;
    double wait = 0.1; /* the longest while anything is queued */
    int queued = 0;
    for (int i = 0; i < self->nfifos; i++) {
        Fifo *f = &self->fifos[i];
        while (f->head < f->len) {
            Entry e = f->items[f->head];
            int live = is_live(self, e.id);
            if (live < 0) goto fail;
            if (e.deadline > now && live) break;
            f->head++;
            if (!live) continue;
            if (nfound == room) {
                room = room ? room * 2 : 16;
                Entry *more = PyMem_Realloc(found, sizeof(Entry) * room);
                if (!more) {
                    PyErr_NoMemory();
                    goto fail;
                }
                found = more;
            }
            found[nfound].id = e.id;
            found[nfound].deadline = f->timeout;
            nfound++;
        }
        if (f->len - f->head > 2 * calls + 1024) {
            Py_ssize_t kept = 0;
            for (Py_ssize_t j = f->head; j < f->len; j++) {
                int live = is_live(self, f->items[j].id);
                if (live < 0) goto fail;
                if (live) f->items[kept++] = f->items[j];
            }
            f->head = 0;
            f->len = kept;
        }
        if (f->head == f->len) {
            f->head = f->len = 0;
        } else {
            queued = 1;
            double left = f->items[f->head].deadline - now;
            if (left < wait) wait = left;
        }
    }
    PyObject *out = PyList_New(nfound);
    if (!out) goto fail;
    for (Py_ssize_t k = 0; k < nfound; k++) {
        PyObject *item = Py_BuildValue("(Ld)", found[k].id, found[k].deadline);
        if (!item) {
            Py_DECREF(out);
            goto fail;
        }
        PyList_SET_ITEM(out, k, item);
    }
    PyMem_Free(found);
    if (!queued) return Py_BuildValue("(NO)", out, Py_None);
    return Py_BuildValue("(Nd)", out, wait > 0.0 ? wait : 0.0);
fail:
    PyMem_Free(found);
    return NULL;
}

/* armed() -> int: deadlines queued (answered calls' entries included until
 * dropped). */
static PyObject *calls_armed(Calls *self, PyObject *unused) {
    Py_ssize_t n = 0;
    for (int i = 0; i < self->nfifos; i++) n += self->fifos[i].len - self->fifos[i].head;
    return PyLong_FromSsize_t(n);
}

static Py_ssize_t calls_len(Calls *self) { return PyDict_GET_SIZE(self->by_id); }

static PyMethodDef calls_methods[] = {
    {"add", (PyCFunction)(void (*)(void))calls_add, METH_FASTCALL,
     "add(msg_id, future, peer, waited, timeout) -> bool: whether to tell the timer."},
    {"arm", (PyCFunction)(void (*)(void))calls_arm, METH_FASTCALL,
     "arm(msg_id, timeout) -> bool: a deadline for a call already added."},
    {"pop", (PyCFunction)calls_pop, METH_O,
     "pop(msg_id) -> Call | None: the call taken out."},
    {"take_peer", (PyCFunction)calls_take_peer, METH_O,
     "take_peer(peer) -> list of the msg_ids waiting on peer."},
    {"expire", (PyCFunction)calls_expire, METH_O,
     "expire(now) -> ([(msg_id, timeout)], wait): the calls past their deadline."},
    {"armed", (PyCFunction)calls_armed, METH_NOARGS, "armed() -> deadlines queued."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef calls_members[] = {
    {"by_id", T_OBJECT, offsetof(Calls, by_id), READONLY,
     "the outstanding calls' futures by message id (read, never write)"},
    {NULL, 0, 0, 0, NULL}};

static PySequenceMethods calls_as_sequence = {.sq_length = (lenfunc)calls_len};

static PyTypeObject CallsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ucxrpc._core.Calls",
    .tp_basicsize = sizeof(Calls),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Calls(call_type): outstanding calls by message id and by peer, and their "
              "deadlines (agent/calls.py's CallTable).",
    .tp_new = calls_new,
    .tp_dealloc = (destructor)calls_dealloc,
    .tp_traverse = (traverseproc)calls_traverse,
    .tp_clear = (inquiry)calls_clear,
    .tp_methods = calls_methods,
    .tp_members = calls_members,
    .tp_as_sequence = &calls_as_sequence,
};

int core_calls_init(PyObject *module) {
    if (PyType_Ready(&CallsType) < 0) return -1;
    Py_INCREF(&CallsType);
    if (PyModule_AddObject(module, "Calls", (PyObject *)&CallsType) < 0) {
        Py_DECREF(&CallsType);
        return -1;
    }
    return 0;
}
