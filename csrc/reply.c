/* Where an rpc_sync call's reply lands (agent/calls.py's SyncReply): its
 * caller drives the loop until it is done, then takes it with wait().
 *
 * Every rpc_sync on a host-only worker makes one, and the reply's
 * handler completes it: in Python that was a class with five slots whose
 * making, completion, test and read were four Python calls a call, and a
 * threading.Event made by a waiter that blocks (issue 52).  Here each is
 * one C call, and a drive reads the flag itself (csrc/loop.c: a Reply is
 * its own done test, called or read).
 *
 * No lock guards the fields: every method holds the GIL throughout and
 * runs no Python code, so a completion and a waiter's look never
 * interleave.  A waiter that must block makes a PyThread lock, held until
 * the reply is set; it waits for it without the GIL, and releases it
 * again once it has it, for any other waiter. */
#include "core.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    int done;
    int waiting; /* threads blocked in wait() */
    int held;    /* lock is held, to be released by the completion */
    PyObject *value, *exc, *kept;
    PyThread_type_lock lock;
} Reply;

static int reply_traverse(Reply *self, visitproc visit, void *arg) {
    Py_VISIT(self->value);
    Py_VISIT(self->exc);
    Py_VISIT(self->kept);
    return 0;
}

static int reply_clear(Reply *self) {
    Py_CLEAR(self->value);
    Py_CLEAR(self->exc);
    Py_CLEAR(self->kept);
    return 0;
}

static void reply_dealloc(Reply *self) {
    PyObject_GC_UnTrack(self);
    reply_clear(self);
    if (self->lock) {
        if (self->held) PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *reply_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Reply() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);
}

int core_reply_done(PyObject *o) {
    if (Py_TYPE(o) != &core_ReplyType) return -1;
    return ((Reply *)o)->done;
}

/* The completion: the value or the error, then the flag, then a blocked
 * waiter let go. */
static void settle(Reply *self, PyObject **slot, PyObject *what) {
    Py_INCREF(what);
    Py_XSETREF(*slot, what);
    self->done = 1;
    if (self->held) {
        self->held = 0;
        PyThread_release_lock(self->lock);
    }
}

static PyObject *reply_set_result(Reply *self, PyObject *value) {
    settle(self, &self->value, value);
    Py_RETURN_NONE;
}

static PyObject *reply_set_exception(Reply *self, PyObject *exc) {
    if (!PyExceptionInstance_Check(exc)) {
        PyErr_Format(PyExc_TypeError, "set_exception() needs an exception, not %R", exc);
        return NULL;
    }
    settle(self, &self->exc, exc);
    Py_RETURN_NONE;
}

static PyObject *reply_done(Reply *self, PyObject *unused) { return PyBool_FromLong(self->done); }

static PyObject *reply_call(Reply *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "a Reply's done test takes no arguments");
        return NULL;
    }
    return PyBool_FromLong(self->done);
}

/* wait() -> the value, or raises the error; blocks until there is one.
 * Ctrl-C interrupts the wait, as threading.Event's. */
static PyObject *reply_wait(Reply *self, PyObject *unused) {
    if (!self->done) {
        if (!self->lock) {
            if (!(self->lock = PyThread_allocate_lock())) return PyErr_NoMemory();
            PyThread_acquire_lock(self->lock, WAIT_LOCK); /* free: taken at once */
            self->held = 1;
        }
        self->waiting++;
        while (!self->done) {
            PyLockStatus got;
            Py_BEGIN_ALLOW_THREADS
            got = PyThread_acquire_lock_timed(self->lock, -1, 1);
            Py_END_ALLOW_THREADS
            if (got == PY_LOCK_ACQUIRED) {
                PyThread_release_lock(self->lock); /* for any other waiter */
                break;
            }
            if (PyErr_CheckSignals() < 0) {
                self->waiting--;
                return NULL;
            }
        }
        self->waiting--;
    }
    if (self->exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(self->exc), self->exc);
        return NULL;
    }
    PyObject *value = self->value ? self->value : Py_None;
    Py_INCREF(value);
    return value;
}

static PyMethodDef reply_methods[] = {
    {"done", (PyCFunction)reply_done, METH_NOARGS, "done() -> bool: whether it was set."},
    {"set_result", (PyCFunction)reply_set_result, METH_O, "set_result(value)"},
    {"set_exception", (PyCFunction)reply_set_exception, METH_O, "set_exception(exc)"},
    {"wait", (PyCFunction)reply_wait, METH_NOARGS,
     "wait() -> the value, or raises the error; blocks until there is one."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef reply_members[] = {
    {"kept", T_OBJECT, offsetof(Reply, kept), 0,
     "what the call's arguments need held until it is answered (RpcAgent.keep_until_answered)"},
    {"waiting", T_INT, offsetof(Reply, waiting), READONLY, "threads blocked in wait()"},
    {NULL, 0, 0, 0, NULL}};

PyTypeObject core_ReplyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ucxrpc._core.Reply",
    .tp_basicsize = sizeof(Reply),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Reply(): where an rpc_sync call's reply lands (agent/calls.py's SyncReply); "
              "called, whether it is done.",
    .tp_new = reply_new,
    .tp_dealloc = (destructor)reply_dealloc,
    .tp_traverse = (traverseproc)reply_traverse,
    .tp_clear = (inquiry)reply_clear,
    .tp_call = (ternaryfunc)reply_call,
    .tp_methods = reply_methods,
    .tp_members = reply_members,
};

int core_reply_init(PyObject *module) {
    if (PyType_Ready(&core_ReplyType) < 0) return -1;
    Py_INCREF(&core_ReplyType);
    if (PyModule_AddObject(module, "Reply", (PyObject *)&core_ReplyType) < 0) {
        Py_DECREF(&core_ReplyType);
        return -1;
    }
    return 0;
}
