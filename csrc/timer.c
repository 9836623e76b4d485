/* A one-shot timer the progress thread, parked deep while other threads
 * drive long (a drive outlasted one of its looks), waits on beside its
 * wake-up descriptor (transport/loop/progress.py, `_park`): a driver that
 * leaves arms it for the lingering time, the next driver disarms it, and
 * the parked thread wakes only when the lingering ran out with no driver,
 * or when woken.  Looking every LINGER_S instead woke it three to four
 * times a 16 MiB call across two hosts on each side, each wake-up
 * preempting a thread moving the data (issue 48).  Python's os module has
 * timerfd from 3.13 only.  The native loop (csrc/loop.c) arms and disarms
 * it as drivers come and go (core_timer_arm); core_monotonic is the clock
 * the core's deadlines and timings share with time.monotonic(). */
#include "core.h"

#include <errno.h>
#include <sys/timerfd.h>
#include <time.h>

/* timer_new() -> fd: a non-blocking, close-on-exec CLOCK_MONOTONIC timerfd. */
static PyObject *py_timer_new(PyObject *self, PyObject *unused) {
    int fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(fd);
}

int core_timer_arm(int fd, double seconds) {
    struct itimerspec spec = {{0, 0}, {0, 0}};
    if (seconds > 0) {
        long long ns = (long long)(seconds * 1e9);
        if (ns < 1) ns = 1; /* all zero would disarm it */
        spec.it_value.tv_sec = (time_t)(ns / 1000000000LL);
        spec.it_value.tv_nsec = (long)(ns % 1000000000LL);
    }
    if (timerfd_settime(fd, 0, &spec, NULL) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

double core_monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* timer_arm(fd, seconds): fire once after `seconds` (replacing any earlier
 * setting); 0 disarms it.  The GIL stays held: the call does not block. */
static PyObject *py_timer_arm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "timer_arm() takes 2 arguments");
        return NULL;
    }
    int fd = (int)PyLong_AsLong(args[0]);
    double seconds = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (seconds < 0) {
        PyErr_SetString(PyExc_ValueError, "timer_arm(): seconds must be >= 0");
        return NULL;
    }
    if (core_timer_arm(fd, seconds) < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef core_timer_methods[] = {
    {"timer_new", (PyCFunction)py_timer_new, METH_NOARGS,
     "timer_new() -> fd: a one-shot monotonic timerfd (non-blocking, close-on-exec)."},
    {"timer_arm", (PyCFunction)(void (*)(void))py_timer_arm, METH_FASTCALL,
     "timer_arm(fd, seconds): fire once after seconds; 0 disarms."},
    {NULL, NULL, 0, NULL}};
