/* ucxrpc._core: the per-message work in C (docs/architecture.md, "The
 * native core").  One file per concern; this header is what they share. */
#ifndef UCXRPC_CORE_H
#define UCXRPC_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Keyword-aware argument parsing for METH_FASTCALL | METH_KEYWORDS
 * functions: fills out[0..nnames) from positional arguments and keywords,
 * leaving NULL what was not given.  Returns -1 with TypeError set on an
 * unknown, repeated or missing (the first `required` names) argument. */
int core_parse(const char *func, const char *const *names, Py_ssize_t nnames,
               Py_ssize_t required, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames, PyObject **out);

/* time.monotonic()'s clock (CLOCK_MONOTONIC), in seconds: the deadlines
 * and the loop's timings compare with what Python code reads. */
double core_monotonic(void);

/* calls.c */
int core_calls_init(PyObject *module);

/* frame.c */
extern PyMethodDef core_frame_methods[];
int core_frame_init(PyObject *module);

/* loop.c */
extern PyMethodDef core_loop_methods[];
int core_loop_init(PyObject *module);

/* reply.c */
extern PyTypeObject core_ReplyType;
int core_reply_init(PyObject *module);
/* A Reply's flag (1 done, 0 not), or -1 if `o` is no Reply: a drive reads
 * it without a call. */
int core_reply_done(PyObject *o);

/* timer.c */
extern PyMethodDef core_timer_methods[];
/* Arm the timerfd `fd` to fire once after `seconds` (0 disarms it): 0, or
 * -1 with OSError set. */
int core_timer_arm(int fd, double seconds);

/* ucp.c */
extern PyMethodDef core_ucp_methods[];
int core_ucp_init(PyObject *module);

#endif
