/* The receive pool's free lists (transport/hostmem/pool.py's HostPool
 * keeps a Pool; its `alloc` is the Pool's).
 *
 * Every large receive takes a buffer here: a message read by address
 * (csrc/receive.c's Inlet, per buffer), one received through UCX, a grant.
 * In Python each cost a lock, a numpy slice, a weakref.finalize and
 * torch.from_numpy on the way out, and the finalizer's call and the lock
 * again on the way back: 3.4 µs alone on the project's Intel VM, 25-30 µs
 * a side of a 1 MiB echo beside a busy process, where the copy before it
 * has just pushed the interpreter out of the caches (issue 52).  Here a
 * buffer goes out as a `Block`, an object exporting just its bytes,
 * wrapped by torch.frombuffer: the tensor's storage holds the block's
 * buffer view, and when the last tensor over it dies torch releases the
 * view, the block dies, and its memory goes back onto its free list.
 * Everything here runs under the GIL (a block dies where a tensor's last
 * reference goes, on any thread, but always holding it), which is what
 * keeps the lists whole: no lock.
 *
 * Memory itself comes from the Python (`make(cls)`: a numpy array, on
 * huge pages from HUGE where the kernel allows), once per buffer the
 * pool never had: only a miss calls it. */
#include "core.h"

#include <structmember.h>

typedef struct {
    PyObject *mem; /* what owns the bytes (make()'s array) */
    char *base;
} entry;

typedef struct {
    size_t cls;
    Py_ssize_t n, cap;
    entry *items;
} freelist;

typedef struct {
    PyObject_HEAD
    PyObject *make;       /* make(nbytes) -> a writable buffer of exactly nbytes */
    PyObject *frombuffer; /* torch.frombuffer */
    PyObject *empty;      /* empty(nbytes) -> a tensor not pooled */
    PyObject *dtype;      /* torch.uint8 */
    PyObject *kwnames;    /* ("dtype",) */
    uint64_t min_bytes, max_cached, page, cached;
    unsigned long long hits, misses;
    freelist *lists;
    Py_ssize_t nlists;
} Pool;

typedef struct {
    PyObject_HEAD
    Pool *pool;    /* NULL once the memory is handed back */
    PyObject *mem;
    char *base, *ptr;
    size_t cls;
    Py_ssize_t len;
} Block;

static PyTypeObject BlockType;

static freelist *list_of(Pool *self, size_t cls, int add) {
    for (Py_ssize_t i = 0; i < self->nlists; i++)
        if (self->lists[i].cls == cls) return &self->lists[i];
    if (!add) return NULL;
    freelist *more = PyMem_Realloc(self->lists, sizeof(freelist) * (size_t)(self->nlists + 1));
    if (!more) return NULL;
    self->lists = more;
    freelist *l = &self->lists[self->nlists++];
    l->cls = cls;
    l->n = l->cap = 0;
    l->items = NULL;
    return l;
}

/* A block's memory back onto its list, or let go where the pool holds
 * enough idle already (or no list can be made: memory is short). */
static void give_back(Pool *self, PyObject *mem, char *base, size_t cls) {
    freelist *l = self->cached + cls <= self->max_cached ? list_of(self, cls, 1) : NULL;
    if (l && l->n == l->cap) {
        Py_ssize_t cap = l->cap ? 2 * l->cap : 4;
        entry *more = PyMem_Realloc(l->items, sizeof(entry) * (size_t)cap);
        if (!more) l = NULL;
        else {
            l->items = more;
            l->cap = cap;
        }
    }
    if (!l) {
        Py_DECREF(mem);
        return;
    }
    l->items[l->n].mem = mem; /* (the reference moves onto the list) */
    l->items[l->n++].base = base;
    self->cached += cls;
}

static int block_getbuffer(Block *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->len, 0, flags);
}

static PyBufferProcs block_as_buffer = {.bf_getbuffer = (getbufferproc)block_getbuffer};

static void block_dealloc(Block *self) {
    if (self->pool) {
        give_back(self->pool, self->mem, self->base, self->cls);
        Py_DECREF(self->pool);
    } else {
        Py_XDECREF(self->mem);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucxrpc._core.Block",
    .tp_basicsize = sizeof(Block),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pool buffer's bytes, lent to the tensors over it (csrc/pool.c).",
    .tp_dealloc = (destructor)block_dealloc,
    .tp_as_buffer = &block_as_buffer,
};

/* A power of two from 1 MiB up wastes at most half, and a steady stream of
 * equal sizes always hits one class (pool.py's reasoning). */
static size_t size_class(uint64_t n) {
    size_t c = 1;
    while (c < n) c <<= 1;
    return c;
}

/* alloc(nbytes, phase=None) -> a 1-D uint8 CPU tensor of nbytes: pooled
 * from min_bytes, or wherever a phase (the address in its page the
 * buffer is to start at) is asked for; else empty(nbytes). */
static PyObject *pool_alloc(Pool *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "alloc() takes (nbytes[, phase])");
        return NULL;
    }
    unsigned long long nbytes = PyLong_AsUnsignedLongLong(args[0]);
    if (nbytes == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int phased = nargs == 2 && args[1] != Py_None;
    uint64_t phase = 0;
    if (phased) {
        phase = PyLong_AsUnsignedLongLong(args[1]);
        if (phase == (uint64_t)-1 && PyErr_Occurred()) return NULL;
        phase %= self->page;
    }
    if ((nbytes < self->min_bytes && !phased) || nbytes == 0 || nbytes > PY_SSIZE_T_MAX / 2)
        return PyObject_CallOneArg(self->empty, args[0]); /* (torch names what is wrong) */
    /* A phased buffer needs a page of room: its own classes, so that plain
     * ones keep exactly their power of two. */
    size_t cls = size_class(nbytes) + (phased ? (size_t)self->page : 0);
    PyObject *mem = NULL;
    char *base = NULL;
    freelist *l = list_of(self, cls, 0);
    if (l && l->n) {
        l->n--;
        mem = l->items[l->n].mem;
        base = l->items[l->n].base;
        self->cached -= cls;
        self->hits++;
    } else {
        self->misses++;
        PyObject *n = PyLong_FromSize_t(cls);
        if (!n) return NULL;
        mem = PyObject_CallOneArg(self->make, n);
        Py_DECREF(n);
        if (!mem) return NULL;
        Py_buffer b;
        if (PyObject_GetBuffer(mem, &b, PyBUF_WRITABLE) < 0) {
            Py_DECREF(mem);
            return NULL;
        }
        base = b.buf;
        Py_ssize_t got = b.len;
        PyBuffer_Release(&b); /* (mem owns the bytes: held as long as mem is) */
        if ((size_t)got < cls) {
            Py_DECREF(mem);
            PyErr_Format(PyExc_ValueError, "make(%zu) gave %zd bytes", cls, got);
            return NULL;
        }
    }
    Block *block = PyObject_New(Block, &BlockType);
    if (!block) {
        give_back(self, mem, base, cls);
        return NULL;
    }
    size_t skip = phased ? (size_t)((phase - (uintptr_t)base % self->page + self->page) %
                                    self->page) : 0;
    block->pool = (Pool *)Py_NewRef(self);
    block->mem = mem;
    block->base = base;
    block->cls = cls;
    block->ptr = base + skip;
    block->len = (Py_ssize_t)nbytes;
    PyObject *fargs[2] = {(PyObject *)block, self->dtype};
    PyObject *t = PyObject_Vectorcall(self->frombuffer, fargs, 1, self->kwnames);
    Py_DECREF(block); /* the tensor's storage holds it now, or it goes back */
    return t;
}

static PyObject *pool_clear(Pool *self, PyObject *unused) {
    for (Py_ssize_t i = 0; i < self->nlists; i++) {
        freelist *l = &self->lists[i];
        while (l->n) {
            l->n--;
            self->cached -= l->cls;
            Py_DECREF(l->items[l->n].mem);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *pool_stats(Pool *self, PyObject *unused) {
    return Py_BuildValue("{sKsKsK}", "cached_bytes", (unsigned long long)self->cached, "hits",
                         self->hits, "misses", self->misses);
}

static int pool_traverse(Pool *self, visitproc visit, void *arg) {
    Py_VISIT(self->make);
    Py_VISIT(self->frombuffer);
    Py_VISIT(self->empty);
    Py_VISIT(self->dtype);
    for (Py_ssize_t i = 0; i < self->nlists; i++)
        for (Py_ssize_t j = 0; j < self->lists[i].n; j++) Py_VISIT(self->lists[i].items[j].mem);
    return 0;
}

static int pool_clear_refs(Pool *self) {
    pool_clear(self, NULL);
    Py_CLEAR(self->make);
    Py_CLEAR(self->frombuffer);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->kwnames);
    return 0;
}

static void pool_dealloc(Pool *self) {
    PyObject_GC_UnTrack(self);
    pool_clear_refs(self);
    for (Py_ssize_t i = 0; i < self->nlists; i++) PyMem_Free(self->lists[i].items);
    PyMem_Free(self->lists);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *const pool_names[] = {"make", "frombuffer", "empty", "dtype", "min_bytes",
                                         "max_cached_bytes", "page"};
#define NPOOL_NAMES ((Py_ssize_t)(sizeof pool_names / sizeof pool_names[0]))

/* Pool(make, frombuffer, empty, dtype, min_bytes, max_cached_bytes, page),
 * keywords only. */
static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *a[NPOOL_NAMES];
    if (core_kwonly("Pool", pool_names, NPOOL_NAMES, args, kwargs, a) < 0) return NULL;
    uint64_t v[3];
    for (int i = 0; i < 3; i++) {
        v[i] = PyLong_AsUnsignedLongLong(a[4 + i]);
        if (v[i] == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    if (!v[2]) {
        PyErr_SetString(PyExc_ValueError, "Pool(): page is not 0");
        return NULL;
    }
    Pool *self = (Pool *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->make = Py_NewRef(a[0]);
    self->frombuffer = Py_NewRef(a[1]);
    self->empty = Py_NewRef(a[2]);
    self->dtype = Py_NewRef(a[3]);
    self->min_bytes = v[0];
    self->max_cached = v[1];
    self->page = v[2];
    if (!(self->kwnames = Py_BuildValue("(s)", "dtype"))) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMethodDef pool_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))pool_alloc, METH_FASTCALL,
     "alloc(nbytes, phase=None) -> a uint8 CPU tensor of nbytes (pooled when large enough, "
     "or phased)."},
    {"clear", (PyCFunction)pool_clear, METH_NOARGS, "clear(): let every idle buffer go."},
    {"stats", (PyCFunction)pool_stats, METH_NOARGS,
     "stats() -> {'cached_bytes', 'hits', 'misses'}"},
    {NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucxrpc._core.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The receive pool's free lists (transport/hostmem/pool.py).",
    .tp_new = pool_new,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_traverse = (traverseproc)pool_traverse,
    .tp_clear = (inquiry)pool_clear_refs,
    .tp_methods = pool_methods,
};

int core_pool_init(PyObject *module) {
    if (PyType_Ready(&BlockType) < 0 || PyType_Ready(&PoolType) < 0) return -1;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(module, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        return -1;
    }
    return 0;
}
