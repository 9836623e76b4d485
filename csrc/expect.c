/* What a drive asks the transport, as rules the core reads itself.
 *
 * A drive asks whether the transport is quiet, whether anything is
 * pending, and what it may expect (transport/loop/progress.py's
 * `expected`): a few truth tests of containers and counters, and the
 * agent's word (calls in flight, a peer that called lately, pool threads
 * running code).  As Python callables they were six calls a drive on each
 * side of a no-op (`_quiet`, the `pending` lambda, `_expected` and the
 * agent's `_spin_while` twice: Run BA).  Here they are data: the
 * transport and the agent say in Python what the answer depends on (their
 * rules, in order, first match wins), and an `Expect` evaluates them
 * without calling Python, but for the one test that is a method
 * (`when`).  The policy stays theirs; this file only reads it.
 *
 * A rule is a tuple:
 *   ("any", terms, why)           why if any term is true
 *   ("overdue", why)              why if the call's `overdue` argument is
 *   ("when", term, fn, why)       why if the term is true and fn() too
 *   ("above", term, why)          why if the term (a number) is above 0
 *   ("within", term, window, why) why if monotonic() - the term (a time)
 *                                 is under window seconds
 *   ("then", why)                 why
 * and a term is an object (its truth, or its number) or (object, name),
 * the object's attribute read at each call.  No rule matching: None. */
#include "core.h"

#include <stddef.h>

typedef enum { ANY, OVERDUE, WHEN, ABOVE, WITHIN, THEN } op_t;

typedef struct {
    PyObject *obj, *name; /* name NULL: the object itself */
} term;

typedef struct {
    op_t op;
    Py_ssize_t nterms;
    term *terms;
    PyObject *fn, *why;
    double window;
} rule;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t nrules;
    rule *rules;
    PyObject *source; /* the rules as given (repr, traverse) */
} Expect;

/* A term's value, a new reference. */
static PyObject *term_value(const term *t) {
    if (!t->name) {
        Py_INCREF(t->obj);
        return t->obj;
    }
    return PyObject_GetAttr(t->obj, t->name);
}

static int term_true(const term *t) {
    if (!t->name) return PyObject_IsTrue(t->obj);
    PyObject *v = PyObject_GetAttr(t->obj, t->name);
    if (!v) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static double term_number(const term *t) {
    PyObject *v = term_value(t);
    if (!v) return -1.0;
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return d;
}

/* 1 if rule `r` matches, 0 if not, -1 on error. */
static int matches(const rule *r, int overdue) {
    switch (r->op) {
    case ANY:
        for (Py_ssize_t i = 0; i < r->nterms; i++) {
            int t = term_true(&r->terms[i]);
            if (t) return t;
        }
        return 0;
    case OVERDUE:
        return overdue;
    case WHEN: {
        int t = term_true(&r->terms[0]);
        if (t <= 0) return t;
        PyObject *v = PyObject_CallNoArgs(r->fn);
        if (!v) return -1;
        t = PyObject_IsTrue(v);
        Py_DECREF(v);
        return t;
    }
    case ABOVE: {
        double d = term_number(&r->terms[0]);
        if (d == -1.0 && PyErr_Occurred()) return -1;
        return d > 0;
    }
    case WITHIN: {
        double d = term_number(&r->terms[0]);
        if (d == -1.0 && PyErr_Occurred()) return -1;
        return core_monotonic() - d < r->window;
    }
    default:
        return 1;
    }
}

static PyObject *expect_vectorcall(Expect *self, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs > 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "an Expect takes one argument, overdue");
        return NULL;
    }
    int overdue = nargs ? PyObject_IsTrue(args[0]) : 0;
    if (overdue < 0) return NULL;
    for (Py_ssize_t i = 0; i < self->nrules; i++) {
        int m = matches(&self->rules[i], overdue);
        if (m < 0) return NULL;
        if (m) {
            Py_INCREF(self->rules[i].why);
            return self->rules[i].why;
        }
    }
    Py_RETURN_NONE;
}

static int read_term(PyObject *o, term *t) {
    if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2 &&
        PyUnicode_Check(PyTuple_GET_ITEM(o, 1))) {
        t->obj = PyTuple_GET_ITEM(o, 0);
        t->name = PyTuple_GET_ITEM(o, 1);
        Py_INCREF(t->obj);
        Py_INCREF(t->name);
        PyUnicode_InternInPlace(&t->name);
    } else {
        t->obj = o;
        t->name = NULL;
        Py_INCREF(o);
    }
    return 0;
}

static const struct { const char *name; op_t op; Py_ssize_t size; } ops[] = {
    {"any", ANY, 3}, {"overdue", OVERDUE, 2}, {"when", WHEN, 4},
    {"above", ABOVE, 3}, {"within", WITHIN, 4}, {"then", THEN, 2}};

static int read_rule(PyObject *o, Py_ssize_t index, rule *r) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) < 2 || !PyUnicode_Check(PyTuple_GET_ITEM(o, 0))) {
        PyErr_Format(PyExc_TypeError, "Expect(): rule %zd must be a tuple (op, ..., why), not %R",
                     index, o);
        return -1;
    }
    size_t k = 0;
    for (; k < sizeof ops / sizeof ops[0]; k++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(o, 0), ops[k].name) == 0) break;
    if (k == sizeof ops / sizeof ops[0] || PyTuple_GET_SIZE(o) != ops[k].size) {
        PyErr_Format(PyExc_ValueError, "Expect(): rule %zd, %R: unknown op or wrong length",
                     index, o);
        return -1;
    }
    r->op = ops[k].op;
    Py_ssize_t n = PyTuple_GET_SIZE(o);
    r->why = PyTuple_GET_ITEM(o, n - 1);
    Py_INCREF(r->why);
    if (r->op == ANY) {
        PyObject *terms = PySequence_Tuple(PyTuple_GET_ITEM(o, 1));
        if (!terms) return -1;
        r->nterms = PyTuple_GET_SIZE(terms);
        r->terms = PyMem_Calloc((size_t)(r->nterms ? r->nterms : 1), sizeof(term));
        if (!r->terms) {
            Py_DECREF(terms);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < r->nterms; i++) read_term(PyTuple_GET_ITEM(terms, i), &r->terms[i]);
        Py_DECREF(terms);
    } else if (r->op == WHEN || r->op == ABOVE || r->op == WITHIN) {
        r->nterms = 1;
        r->terms = PyMem_Calloc(1, sizeof(term));
        if (!r->terms) {
            PyErr_NoMemory();
            return -1;
        }
        read_term(PyTuple_GET_ITEM(o, 1), &r->terms[0]);
        if (r->op == WHEN) {
            r->fn = PyTuple_GET_ITEM(o, 2);
            if (!PyCallable_Check(r->fn)) {
                PyErr_Format(PyExc_TypeError, "Expect(): rule %zd's test is not callable", index);
                r->fn = NULL;
                return -1;
            }
            Py_INCREF(r->fn);
        } else if (r->op == WITHIN) {
            r->window = PyFloat_AsDouble(PyTuple_GET_ITEM(o, 2));
            if (r->window == -1.0 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

static void free_rules(Expect *self) {
    for (Py_ssize_t i = 0; i < self->nrules; i++) {
        rule *r = &self->rules[i];
        for (Py_ssize_t j = 0; j < r->nterms; j++) {
            Py_CLEAR(r->terms[j].obj);
            Py_CLEAR(r->terms[j].name);
        }
        PyMem_Free(r->terms);
        r->terms = NULL;
        r->nterms = 0;
        Py_CLEAR(r->fn);
        Py_CLEAR(r->why);
    }
    PyMem_Free(self->rules);
    self->rules = NULL;
    self->nrules = 0;
}

static int expect_traverse(Expect *self, visitproc visit, void *arg) {
    Py_VISIT(self->source);
    for (Py_ssize_t i = 0; i < self->nrules; i++) {
        rule *r = &self->rules[i];
        for (Py_ssize_t j = 0; j < r->nterms; j++) Py_VISIT(r->terms[j].obj);
        Py_VISIT(r->fn);
        Py_VISIT(r->why);
    }
    return 0;
}

static int expect_clear(Expect *self) {
    Py_CLEAR(self->source);
    free_rules(self);
    return 0;
}

static void expect_dealloc(Expect *self) {
    PyObject_GC_UnTrack(self);
    expect_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Expect(rules): see the top of this file. */
static PyObject *expect_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 1 || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Expect() takes one argument, its rules");
        return NULL;
    }
    PyObject *rules = PySequence_Tuple(PyTuple_GET_ITEM(args, 0));
    if (!rules) return NULL;
    Expect *self = (Expect *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(rules);
        return NULL;
    }
    self->vectorcall = (vectorcallfunc)expect_vectorcall;
    self->source = rules;
    Py_ssize_t n = PyTuple_GET_SIZE(rules);
    self->rules = PyMem_Calloc((size_t)(n ? n : 1), sizeof(rule));
    if (!self->rules) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->nrules = n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (read_rule(PyTuple_GET_ITEM(rules, i), i, &self->rules[i]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    return (PyObject *)self;
}

static PyObject *expect_repr(Expect *self) {
    return PyUnicode_FromFormat("Expect(%R)", self->source);
}

static PyTypeObject ExpectType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucxrpc._core.Expect",
    .tp_basicsize = sizeof(Expect),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "What a drive asks the transport, as rules read in C (csrc/expect.c): called "
              "with overdue, the first matching rule's why, else None.",
    .tp_new = expect_new,
    .tp_dealloc = (destructor)expect_dealloc,
    .tp_traverse = (traverseproc)expect_traverse,
    .tp_clear = (inquiry)expect_clear,
    .tp_vectorcall_offset = offsetof(Expect, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = (reprfunc)expect_repr,
};

int core_expect_init(PyObject *module) {
    if (PyType_Ready(&ExpectType) < 0) return -1;
    Py_INCREF(&ExpectType);
    if (PyModule_AddObject(module, "Expect", (PyObject *)&ExpectType) < 0) {
        Py_DECREF(&ExpectType);
        return -1;
    }
    return 0;
}
