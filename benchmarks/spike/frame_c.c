/* Spike (Run AL): a no-buffer MESSAGE frame's header encode and decode in C
 * with the CPython API, to weigh against the same in Cython and in Python
 * (ucxrpc/transport/wire/frame.py's layout: "<2sBBHHIQQ" prefix, payload,
 * MAC).  The MAC is hashlib's blake2b called through the API, as the Cython
 * twin calls it, so the two differ only in glue. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>

#define PREFIX 28
#define MAC_LEN 16
static PyObject *blake2b;  /* hashlib.blake2b */
static PyObject *kw_names;

static int mac_into(const char *key, Py_ssize_t keylen, const char *head, Py_ssize_t n,
                    uint64_t size, char *out) {
    PyObject *args = Py_BuildValue("(y#)", head, n);
    PyObject *kw = Py_BuildValue("{s:y#,s:i}", "key", key, keylen, "digest_size", MAC_LEN);
    PyObject *h = PyObject_Call(blake2b, args, kw);
    Py_DECREF(args); Py_DECREF(kw);
    if (!h) return -1;
    char sz[8]; memcpy(sz, &size, 8);
    PyObject *r = PyObject_CallMethod(h, "update", "y#", sz, (Py_ssize_t)8);
    if (!r) { Py_DECREF(h); return -1; }
    Py_DECREF(r);
    PyObject *d = PyObject_CallMethod(h, "digest", NULL);
    Py_DECREF(h);
    if (!d) return -1;
    memcpy(out, PyBytes_AS_STRING(d), MAC_LEN);
    Py_DECREF(d);
    return 0;
}

static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* encode(kind, seq, payload, key, ack, busy, seal) -> bytearray */
    if (nargs != 7) { PyErr_SetString(PyExc_TypeError, "7 arguments"); return NULL; }
    long kind = PyLong_AsLong(args[0]);
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    Py_buffer payload, key;
    if (PyObject_GetBuffer(args[2], &payload, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[3], &key, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&payload); return NULL; }
    unsigned long long ack = PyLong_AsUnsignedLongLong(args[4]);
    int busy = PyObject_IsTrue(args[5]), seal = PyObject_IsTrue(args[6]);
    Py_ssize_t head = PREFIX + payload.len, size = head + MAC_LEN;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, size);
    if (!out) goto fail;
    char *p = PyByteArray_AS_STRING(out);
    uint16_t nbuf = 0, state = busy ? 1 : 0; uint32_t plen = (uint32_t)payload.len;
    p[0] = 'U'; p[1] = 'X'; p[2] = 7; p[3] = (char)kind;
    memcpy(p + 4, &nbuf, 2); memcpy(p + 6, &state, 2); memcpy(p + 8, &plen, 4);
    memcpy(p + 12, &seq, 8); memcpy(p + 20, &ack, 8);
    memcpy(p + PREFIX, payload.buf, payload.len);
    if (seal) {
        if (mac_into(key.buf, key.len, p, head, (uint64_t)size, p + head) < 0) { Py_DECREF(out); out = NULL; }
    } else memset(p + head, 0, MAC_LEN);
fail:
    PyBuffer_Release(&payload); PyBuffer_Release(&key);
    return out;
}

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* decode(frame, key) -> (kind, seq, payload memoryview, ack, busy) */
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "2 arguments"); return NULL; }
    Py_buffer b, key;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &key, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&b); return NULL; }
    const char *p = b.buf; Py_ssize_t n = b.len; PyObject *res = NULL;
    if (n < PREFIX + MAC_LEN || p[0] != 'U' || p[1] != 'X' || p[2] != 7) {
        PyErr_SetString(PyExc_ValueError, "bad frame"); goto out;
    }
    uint32_t plen; uint64_t seq, ack; uint16_t state;
    memcpy(&state, p + 6, 2); memcpy(&plen, p + 8, 4); memcpy(&seq, p + 12, 8); memcpy(&ack, p + 20, 8);
    Py_ssize_t head = PREFIX + plen;
    if (head + MAC_LEN > n) { PyErr_SetString(PyExc_ValueError, "truncated"); goto out; }
    char want[MAC_LEN];
    if (mac_into(key.buf, key.len, p, head, (uint64_t)n, want) < 0) goto out;
    unsigned diff = 0;
    for (int i = 0; i < MAC_LEN; i++) diff |= (unsigned char)(want[i] ^ p[n - MAC_LEN + i]);
    if (diff) { PyErr_SetString(PyExc_ValueError, "MAC mismatch"); goto out; }
    PyObject *mv = PyMemoryView_FromObject(args[0]);
    if (!mv) goto out;
    PyObject *payload = PySequence_GetSlice(mv, PREFIX, head);
    Py_DECREF(mv);
    if (!payload) goto out;
    res = Py_BuildValue("(iKNKO)", (int)(unsigned char)p[3], (unsigned long long)seq, payload,
                        (unsigned long long)ack, state ? Py_True : Py_False);
out:
    PyBuffer_Release(&b); PyBuffer_Release(&key);
    return res;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, NULL},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "frame_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_frame_c(void) {
    PyObject *hashlib = PyImport_ImportModule("hashlib");
    if (!hashlib) return NULL;
    blake2b = PyObject_GetAttrString(hashlib, "blake2b");
    Py_DECREF(hashlib);
    if (!blake2b) return NULL;
    (void)kw_names;
    return PyModule_Create(&mod);
}
