/* plain_pickle(obj) -> bytes | None: a plain message pickled in one call.
 *
 * Most calls carry no tensor: a function and a few numbers or strings (a
 * no-op, an RRef's bookkeeping, a parameter server's keys), and most replies
 * are None or such values.  Serializer.dumps gives them seven Python calls
 * (the run scan, the pickler's acquisition, reset and tensor hook); pickle's
 * own dumps gives them none.  The two write the same bytes for what is
 * plain here, because ucxrpc's pickler changes nothing for it:
 *
 *   - None, bool, int, float, str, bytes: pickle writes them before any
 *     hook could see them;
 *   - tuple, list, dict of plain values: pickle walks them in C without a
 *     hook, and with_runs only replaces containers of tensors;
 *   - a Python function, a class (of metaclass type) and a builtin function
 *     whose __self__ is None, a module or such a class: pickled by name; the
 *     tensor hook answers NotImplemented for them.
 *
 * Anything else, more than PLAIN_VALUES values or deeper than PLAIN_DEPTH
 * (a cycle included), is not plain: None, and the caller pickles it the
 * long way.  So is a plain object pickle fails on (a lambda, a local
 * function): the long way raises its error with the serializer's words.
 * The caller marks the message plain (envelope.PLAIN), and the receiver
 * unpickles it with pickle's loads, without a loader for buffers it has
 * none of. */
#include "core.h"

/* As serialization/bundle.py's with_runs looks at a message: what it sees
 * whole, this sees. */
#define PLAIN_VALUES 64
#define PLAIN_DEPTH 4

static PyObject *pickle_dumps; /* _pickle.dumps */
static PyObject *protocol;     /* 5, as serialization.pickler.PROTOCOL */
static PyObject *none_pickled; /* pickle.dumps(None, 5): every void reply */

static int by_name(PyObject *o) {
    PyTypeObject *t = Py_TYPE(o);
    if (t == &PyFunction_Type || t == &PyType_Type) return 1;
    if (t == &PyCFunction_Type) {
        /* A bound builtin method pickles its __self__ (a list's append, its
         * list): only one of a module or a class is plain. */
        PyObject *self = PyCFunction_GET_SELF(o);
        return self == NULL || PyModule_CheckExact(self) || Py_IS_TYPE(self, &PyType_Type);
    }
    return 0;
}

/* 1 plain, 0 not; never an error.  *left: values still to look at. */
static int is_plain(PyObject *o, int depth, Py_ssize_t *left) {
    PyTypeObject *t = Py_TYPE(o);
    if (o == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyFloat_Type ||
        t == &PyUnicode_Type || t == &PyBytes_Type)
        return 1;
    if (t == &PyTuple_Type || t == &PyList_Type || t == &PyDict_Type) {
        Py_ssize_t n = t == &PyDict_Type ? PyDict_GET_SIZE(o) : Py_SIZE(o);
        if (n == 0) return 1;
        if (depth >= PLAIN_DEPTH || (*left -= n) < 0) return 0;
        if (t == &PyDict_Type) {
            PyObject *k, *v;
            Py_ssize_t pos = 0;
            while (PyDict_Next(o, &pos, &k, &v))
                if (!is_plain(k, depth + 1, left) || !is_plain(v, depth + 1, left)) return 0;
            return 1;
        }
        /* (A list's items are read under the GIL, which this holds
         * throughout: no Python code runs here to change it.) */
        PyObject **items = t == &PyTuple_Type ? ((PyTupleObject *)o)->ob_item
                                             : ((PyListObject *)o)->ob_item;
        for (Py_ssize_t i = 0; i < n; i++)
            if (!is_plain(items[i], depth + 1, left)) return 0;
        return 1;
    }
    return by_name(o);
}

static PyObject *plain_pickle(PyObject *module, PyObject *obj) {
    (void)module;
    if (obj == Py_None) return Py_NewRef(none_pickled);
    Py_ssize_t left = PLAIN_VALUES;
    if (!is_plain(obj, 0, &left)) Py_RETURN_NONE;
    PyObject *args[2] = {obj, protocol};
    PyObject *out = PyObject_Vectorcall(pickle_dumps, args, 2, NULL);
    if (!out && PyErr_ExceptionMatches(PyExc_Exception)) {
        /* The long way raises it again, as the serializer words it. */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef plain_methods[] = {
    {"plain_pickle", (PyCFunction)plain_pickle, METH_O,
     "plain_pickle(obj) -> bytes | None: obj pickled (protocol 5) where it is plain "
     "(no tensor, nothing pickled by a hook: see csrc/plain.c), else None."},
    {NULL, NULL, 0, NULL},
};

int core_plain_init(PyObject *module) {
    PyObject *pickle = PyImport_ImportModule("_pickle");
    if (!pickle) return -1;
    pickle_dumps = PyObject_GetAttrString(pickle, "dumps");
    Py_DECREF(pickle);
    if (!pickle_dumps) return -1;
    if (!(protocol = PyLong_FromLong(5))) return -1;
    PyObject *args[2] = {Py_None, protocol};
    if (!(none_pickled = PyObject_Vectorcall(pickle_dumps, args, 2, NULL))) return -1;
    return PyModule_AddFunctions(module, plain_methods);
}
