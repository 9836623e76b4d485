/* ucxrpc._core's module object: its methods, gathered from the files that
 * implement them, and the argument parsing they share. */
#include "core.h"

int core_parse(const char *func, const char *const *names, Py_ssize_t nnames,
               Py_ssize_t required, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames, PyObject **out) {
    if (nargs > nnames) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments (%zd given)", func,
                     nnames, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nnames; i++) out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = 0;
        for (; i < nnames; i++)
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) break;
        if (i == nnames) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", func,
                         key);
            return -1;
        }
        if (out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", func,
                         names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < required; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", func,
                         names[i]);
            return -1;
        }
    return 0;
}

int core_kwonly(const char *type, const char *const *names, Py_ssize_t nnames, PyObject *args,
                PyObject *kwargs, PyObject **out) {
    if (PyTuple_GET_SIZE(args)) {
        PyErr_Format(PyExc_TypeError, "%s() takes keyword arguments only", type);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nnames; i++) out[i] = NULL;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (kwargs && PyDict_Next(kwargs, &pos, &key, &value)) {
        Py_ssize_t i = 0;
        for (; i < nnames; i++)
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) break;
        if (i == nnames) {
            PyErr_Format(PyExc_TypeError, "%s(): unexpected argument '%U'", type, key);
            return -1;
        }
        out[i] = value;
    }
    for (Py_ssize_t i = 0; i < nnames; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing argument '%s'", type, names[i]);
            return -1;
        }
    return 0;
}

int core_attr_u64(PyObject *o, PyObject *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = n;
    return 0;
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ucxrpc._core",
    .m_doc = "ucxrpc's per-message work in C: frames and their MAC, libucp's "
             "per-message calls, the table of calls in flight, the progress loop's "
             "hand-over and a driver's turns, an rpc_sync's reply slot, a message "
             "without buffers sent in one call, the frames taken handed on, what a drive "
             "asks as rules, a plain message pickled in one call, the receive pool's "
             "free lists (see "
             "docs/architecture.md, 'The native core').",
    .m_size = -1,  /* module state is static: one interpreter per process */
    .m_methods = core_frame_methods,
};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddFunctions(m, core_ucp_methods) < 0 ||
        PyModule_AddFunctions(m, core_timer_methods) < 0 ||
        PyModule_AddFunctions(m, core_loop_methods) < 0 || core_frame_init(m) < 0 ||
        core_calls_init(m) < 0 || core_loop_init(m) < 0 || core_reply_init(m) < 0 ||
        core_send_init(m) < 0 || core_receive_init(m) < 0 || core_expect_init(m) < 0 ||
        core_plain_init(m) < 0 || core_pool_init(m) < 0 || core_ucp_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
