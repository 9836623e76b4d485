/* The progress loop's hand-over and a driver's turns (transport/loop/
 * progress.py keeps the progress thread's own loop, its parking and its
 * sleep in epoll, and says what each piece means).
 *
 * Every rpc_sync and every request served drives the loop twice over on
 * each side: a waiting thread takes the loop (`hand` to DRIVER), turns or
 * spins until its message is handled, and hands the loop back.  In Python
 * that was ~40 calls a side of a no-op call, ~7 µs on this project's VM
 * from the message handled to the drive over (issue 52,
 * benchmarks/runs/AY.md): the owner's move table under a lock, the
 * checks around each turn, the timing of each spin.  Here the drive is
 * one C call; what it asks the transport (`done`, `expected`, `quiet`,
 * `pending`, a turn) and the strategy stay Python callables, as they read
 * Python state.
 *
 * No lock guards the owner: every method holds the GIL throughout and
 * runs no Python code while it reads or moves the owner, so another
 * thread never sees half a move (as csrc/calls.c's table).  The baton, the
 * lock a turn runs under, is a PyThread lock: tried without the GIL
 * released (a driver never waits for it), waited for with the GIL released
 * by the progress thread only (`turn`). */
#include "core.h"

#include <sched.h>
#include <structmember.h>
#include <unistd.h>

/* The owners, in the order Loop() is given them (progress.py's Owner). */
enum { THREAD, DRIVER, LINGER, STOPPED, NOWNERS };

/* Whether this thread drives the loop or sends (guard()): a callback run
 * inside a turn must not drive again (turns do not nest), and Ctrl-C waits
 * until the section ends (transport/loop/interrupts.py). */
static _Thread_local int turning;
/* The process's SigintGuard (turning_bind): its `held` and `deliver()`. */
static PyObject *sigint_guard;
static PyObject *str_held, *str_deliver, *str_blocked_until, *str_refusal, *str_late_s,
    *str_spun, *str_yielded;

/* obj.name(*floats), the arguments made floats: 0, or -1 on error. */
static int call_floats(PyObject *obj, PyObject *name, const double *v, int n) {
    PyObject *args[4] = {obj, NULL, NULL, NULL};
    int made = 1;
    for (; made <= n; made++)
        if (!(args[made] = PyFloat_FromDouble(v[made - 1]))) break;
    PyObject *r = made > n ? PyObject_VectorcallMethod(
                                 name, args, (size_t)(n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                 NULL)
                           : NULL;
    for (int i = 1; i < made; i++) Py_DECREF(args[i]);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

typedef struct {
    PyObject_HEAD
    PyObject *owners[NOWNERS]; /* the Owner members, by index */
    unsigned moves[NOWNERS];   /* bit j of moves[i]: i -> j allowed (_MOVES) */
    int owner;
    int stopping; /* owner == STOPPED, a plain read for the loops */
    unsigned long driver;
    int has_driver;
    double driver_left, drive_started;
    /* The progress thread parked deep (it sleeps through drives until the
     * linger timer fires) and that timer armed: progress.py's _park. */
    int park_deep, linger_armed;
    int linger_fd, wake_fd, park_fd;
    double linger_s, spin_s, spin_chunk_s, sleep_s;
    /* What wakers read, from any thread. */
    int sleeping, driver_sleeping, driver_spinning, parked;
    unsigned long thread_ident; /* the progress thread's, once it runs */
    int has_thread;
    long long drives, driven_turns, spins, timer_sets;
    PyThread_type_lock baton;
    PyObject *progress, *turn, *expected, *pending, *quiet, *spin, *on_taken, *sleep,
        *on_error, *strategy, *awaited, *polls, *last_why;
} Loop;


/* The linger timer (csrc/timer.c), counted. */
static int timer_set(Loop *self, double seconds) {
    if (self->linger_fd < 0) return 0; /* released (forget) */
    self->timer_sets++;
    return core_timer_arm(self->linger_fd, seconds);
}

/* eventfd_write(fd, 1), a closed descriptor ignored (the loop is gone). */
static void poke(int fd) {
    if (fd < 0) return; /* released (forget) */
    uint64_t one = 1;
    ssize_t n = write(fd, &one, sizeof one);
    (void)n;
}

/* Whether the collector cleared it (tp_clear: a cycle found unreachable,
 * whose other members' finalizers may still reach it): every method that
 * calls back into Python asks first. */
static int cleared(Loop *self) {
    if (self->expected && self->strategy && self->owners[0]) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the progress loop was torn down");
    return 1;
}

/* ------------------------------------------------------------ the owner */

static int owner_index(Loop *self, PyObject *owner) {
    for (int i = 0; i < NOWNERS; i++)
        if (self->owners[i] == owner) return i;
    PyErr_Format(PyExc_TypeError, "not an owner of this loop: %R", owner);
    return -1;
}

/* Move the loop to `to` if the table allows it from where it is (and it is
 * at `only_from`, unless -1): 1 moved, 0 not, -1 error.  The one place the
 * owner changes. */
static int hand_to(Loop *self, int to, unsigned long driver, int only_from) {
    int was = self->owner;
    if (!(self->moves[was] & (1u << to)) || (only_from >= 0 && was != only_from)) return 0;
    if (was == DRIVER) self->driver_left = core_monotonic();
    if (self->park_deep) { /* the parked thread sleeps through drives */
        if (to == LINGER) {
            /* The timer ends its linger. */
            if (timer_set(self, self->linger_s) < 0) return -1;
            self->linger_armed = 1;
            /* A short drive: back to looks, once the timer has woken it
             * (no later driver disarms it: not deep). */
            if (self->driver_left - self->drive_started < self->linger_s) self->park_deep = 0;
        } else if (to == DRIVER && self->linger_armed) {
            /* (One that fires anyway costs the thread a look.) */
            if (timer_set(self, 0.0) < 0) return -1;
            self->linger_armed = 0;
        }
    }
    if (to == DRIVER) self->drive_started = core_monotonic();
    self->has_driver = to == DRIVER;
    self->driver = to == DRIVER ? driver : 0;
    self->owner = to;
    self->stopping = to == STOPPED;
    return 1;
}

/* ------------------------------------------------- calls into Python */

static int call_truth(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    if (!r) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* done(): a Reply's flag read (an rpc_sync's, csrc/reply.c), any other
 * test called. */
static int is_done(PyObject *done) {
    int t = core_reply_done(done);
    return t >= 0 ? t : call_truth(done);
}

/* The Exception now raised, handed to on_error (it logs "progress loop
 * error (continuing)"): 0, or -1 if it is no Exception (Ctrl-C, a
 * SystemExit: left raised) or on_error raised. */
static int swallow(Loop *self) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallOneArg(self->on_error, value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Whether the process's SigintGuard holds a Ctrl-C: 1, 0, -1 error. */
static int sigint_held(void) {
    if (!sigint_guard) return 0;
    PyObject *held = PyObject_GetAttr(sigint_guard, str_held);
    if (!held) return -1;
    int is = held != Py_None;
    Py_DECREF(held);
    return is;
}

/* The guard's deliver() where it holds one (it raises KeyboardInterrupt,
 * by default): 0, or -1 with that raised. */
static int sigint_deliver(void) {
    int held = sigint_held();
    if (held <= 0) return held;
    PyObject *r = PyObject_CallMethodNoArgs(sigint_guard, str_deliver);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* An error was put aside (type, value, tb, fetched: this steals them) and
 * another is raised now, by cleaning up after the first: the first
 * becomes the new one's __context__, as a Python `finally:` that raises
 * leaves it, so that a Ctrl-C delivered over a failed drive or send still
 * shows what failed.  Nothing put aside (type NULL): nothing to do. */
void core_chain_over(PyObject *type, PyObject *value, PyObject *tb) {
    if (!type) return;
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    if (!t2) { /* nothing raised since after all: the first stands */
        PyErr_Restore(type, value, tb);
        return;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2 && v2 != value) PyException_SetContext(v2, value); /* steals value */
    else Py_XDECREF(value);
    Py_DECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(t2, v2, tb2);
}

static double strategy_float(Loop *self, PyObject *name) {
    PyObject *v = PyObject_GetAttr(self->strategy, name);
    if (!v) return -1.0;
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return d;
}

/* progress.py's decide(): whether the next turn may poll, and why (a new
 * reference to a Why, kept in last_why), NULL on error. */
static PyObject *decide(Loop *self, double now, double idle) {
    PyObject *why = PyObject_CallOneArg(self->expected, idle >= self->spin_s ? Py_True : Py_False);
    if (!why) return NULL;
    int polls = PySet_Contains(self->polls, why);
    if (polls < 0) goto fail;
    if (polls) {
        double blocked_until = strategy_float(self, str_blocked_until);
        if (blocked_until == -1.0 && PyErr_Occurred()) goto fail;
        if (now < blocked_until) {
            PyObject *refusal = PyObject_GetAttr(self->strategy, str_refusal);
            if (!refusal) goto fail;
            Py_SETREF(why, refusal);
        }
    }
    Py_INCREF(why);
    Py_SETREF(self->last_why, why);
    return why;
fail:
    Py_DECREF(why);
    return NULL;
}

/* Give the core to whoever wants it, and learn whether anyone did from how
 * long that took (the strategy's yielded). */
static int yield_core(Loop *self, double now) {
    double before = core_monotonic();
    Py_BEGIN_ALLOW_THREADS
    sched_yield();
    Py_END_ALLOW_THREADS
    double v[2] = {now, core_monotonic() - before};
    return call_floats(self->strategy, str_yielded, v, 2);
}

/* UCX progress and the transport's turn, the baton held: whether it
 * handled anything (an error logged counts as busy), -1 on an error that
 * is no Exception. */
static int one_turn(Loop *self) {
    PyObject *r = PyObject_CallNoArgs(self->progress);
    if (r) {
        Py_DECREF(r);
        int busy = call_truth(self->turn);
        if (busy >= 0) return busy;
    }
    return swallow(self) < 0 ? -1 : 1;
}

/* The driver's idle turns in native code (the transport's spin, ucp_spin
 * in csrc/ucp.c), under the baton, until a frame waits, a yield comes back
 * late, someone wakes the loop, or the awaited message is overdue (or
 * spin_chunk_s passed): an idle turn in Python cost ~23 calls (Run AM).
 * The frames it finds are handed on here, still under the baton: left for
 * the next turn, each cost one on both sides of every call (Run AU).
 * Whether it handed any on; -1 on an error that is no Exception. */
static int spun(Loop *self, double idle) {
    if (!PyThread_acquire_lock(self->baton, NOWAIT_LOCK))
        return yield_core(self, core_monotonic()) < 0 ? -1 : 0;
    long quick = 0;
    double late = 0.0;
    int handed = 0, failed = 0;
    self->driver_spinning = 1;
    self->spins++;
    double budget = self->spin_s - idle;
    if (budget > self->spin_chunk_s) budget = self->spin_chunk_s;
    /* spin(wake_fd, budget_s, late_s), called without an argument tuple:
     * the transport's is a partial of ucp_spin, which takes them on. */
    PyObject *res = NULL, *args[3] = {PyLong_FromLong(self->wake_fd),
                                       PyFloat_FromDouble(budget),
                                       PyObject_GetAttr(self->strategy, str_late_s)};
    if (args[0] && args[1] && args[2]) res = PyObject_Vectorcall(self->spin, args, 3, NULL);
    for (int i = 0; i < 3; i++) Py_XDECREF(args[i]);
    self->driver_spinning = 0;
    if (res) {
        PyObject *taken = NULL;
        if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 4) {
            PyErr_SetString(PyExc_TypeError, "spin() must return (why, quick, late, taken)");
        } else {
            quick = PyLong_AsLong(PyTuple_GET_ITEM(res, 1));
            if (!PyErr_Occurred()) late = PyFloat_AsDouble(PyTuple_GET_ITEM(res, 2));
            taken = PyTuple_GET_ITEM(res, 3);
            if (!PyErr_Occurred() && taken != Py_None) {
                handed = 1;
                PyObject *r = PyObject_CallOneArg(self->on_taken, taken);
                Py_XDECREF(r);
            }
        }
        Py_DECREF(res);
    }
    /* As a turn's: UCX's progress raising must not end the wait of the
     * caller who happened to drive. */
    if (PyErr_Occurred() && swallow(self) < 0) failed = 1;
    self->driver_spinning = 0;
    PyThread_release_lock(self->baton);
    if (failed) return -1;
    /* A spin with no yield to report (a message found before the first)
     * tells the strategy nothing: not asked, a Python call fewer a drive. */
    if (!quick && !late) return handed;
    double v[3] = {core_monotonic(), (double)quick, late};
    return call_floats(self->strategy, str_spun, v, 3) < 0 ? -1 : handed;
}

/* progress.py's sleep(now, timeout), the driver's flag set around it. */
static int driver_sleep(Loop *self, double now, double timeout) {
    self->driver_sleeping = 1;
    PyObject *r = PyObject_CallFunction(self->sleep, "dd", now, timeout);
    self->driver_sleeping = 0;
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Turn until done() (1) or nothing is expected (0); -1 on error.
 *
 * Where the strategy may not poll (a contended core, or the blocking
 * mode), the driver waits for UCX's next event in epoll itself rather than
 * handing the loop back: the message then wakes the thread that wants it,
 * one wake-up instead of two (the progress thread's, then the waiter's),
 * and the core is free meanwhile. */
static int drive_turns(Loop *self, PyObject *done) {
    double last_event = core_monotonic(), now = last_event, idle = 0.0;
    /* A quiet transport (nothing in flight, due or queued) gives a turn
     * nothing to do that the native spin does not, where the driver will
     * spin: as a drive opens, and after a spin that handed frames on, it
     * goes straight to the spin, which takes whatever already waits.  Each
     * such turn cost a call to ucxx's progress and three Python calls, one
     * a drive on each side of a call (Run AU).  A driver that will not
     * spin (a pool thread while another runs user code, say) turns first:
     * it may leave at once, and what already waited would then wait for
     * the progress thread. */
    int spin_next = self->spin != Py_None;
    PyObject *why;
    for (;;) {
        int t = is_done(done);
        if (t != 0) return t;
        if (self->stopping) return 0;
        if ((t = sigint_held()) != 0) return t < 0 ? -1 : 0;
        why = NULL;
        if (spin_next) {
            spin_next = 0;
            int q = call_truth(self->quiet);
            if (q < 0) return -1;
            if (q) {
                now = core_monotonic();
                idle = now - last_event;
                if (!(why = decide(self, now, idle))) return -1;
                if (why != self->awaited) Py_CLEAR(why); /* a turn first */
            }
        }
        int quiet = why != NULL;
        if (!why) {
            int busy = 0;
            if (PyThread_acquire_lock(self->baton, NOWAIT_LOCK)) {
                /* A driver turns two or three times a call made or served. */
                self->driven_turns++;
                busy = one_turn(self);
                PyThread_release_lock(self->baton);
                if (busy < 0) return -1;
            }
            now = core_monotonic();
            if (busy) {
                last_event = now;
                continue;
            }
            idle = now - last_event;
            if (!(why = decide(self, now, idle))) return -1;
        }
        int polls = PySet_Contains(self->polls, why);
        if (polls < 0) goto fail;
        if (polls) {
            int spin = 0;
            if (why == self->awaited && self->spin != Py_None) {
                spin = quiet ? 1 : call_truth(self->quiet);
                if (spin < 0) goto fail;
            }
            if (spin) {
                int s = spun(self, idle);
                if (s < 0) goto fail;
                if (s) {
                    last_event = core_monotonic();
                    spin_next = 1;
                }
            } else if (yield_core(self, now) < 0) {
                goto fail;
            }
            Py_DECREF(why);
            continue;
        }
        PyObject *refusal = PyObject_GetAttr(self->strategy, str_refusal);
        if (!refusal) goto fail;
        int refused = why == refusal;
        Py_DECREF(refusal);
        Py_DECREF(why);
        if (!refused) return 0; /* nothing expected: the progress thread takes over */
        /* Until the awaited message is overdue; data in flight keeps it
         * expected, and its events end the wait. */
        double left = self->spin_s - idle;
        if (driver_sleep(self, now, left > 0 ? left : self->sleep_s) < 0) return -1;
    }
fail:
    Py_DECREF(why);
    return -1;
}

/* drive(done) -> bool: see progress.py's ProgressThread, where it is bound. */
static PyObject *loop_drive(Loop *self, PyObject *done) {
    if (cleared(self)) return NULL;
    unsigned long me = PyThread_get_thread_ident();
    if (self->stopping || (self->has_thread && me == self->thread_ident) || turning)
        Py_RETURN_FALSE;
    turning = 1; /* first: nothing below may be cut short by Ctrl-C */
    int reached = 0;
    int moved = hand_to(self, DRIVER, me, -1); /* not while another thread drives */
    if (moved < 0) reached = -1;
    if (moved > 0) {
        self->drives++;
        int handed_back = 1;
        reached = drive_turns(self, done);
        if (reached == 1) {
            PyObject *why = PyObject_CallOneArg(self->expected, Py_False);
            int polls = why ? PySet_Contains(self->polls, why) : -1;
            Py_XDECREF(why);
            int pending = polls == 0 ? call_truth(self->pending) : 0;
            if (polls < 0 || pending < 0) reached = -1;
            else handed_back = polls || pending;
        }
        /* Parked, the progress thread lingers (linger_s) unless woken: a
         * driver that gave up, or left work behind, hands the loop back at
         * once.  (It reads the owner after setting parked, and we read
         * parked after moving the owner, so one of us sees the other.) */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (hand_to(self, handed_back ? THREAD : LINGER, 0, -1) < 0) {
            core_chain_over(type, value, tb); /* raised in the finally: it wins, as in Python */
            reached = -1;
        } else {
            PyErr_Restore(type, value, tb);
            if (handed_back && self->parked) poke(self->park_fd);
        }
    }
    turning = 0;
    /* A Ctrl-C held meanwhile raises KeyboardInterrupt here, in place of
     * any other error, that error its context (as a Python finally would);
     * the error of the drive, if any, is put aside while the guard is
     * asked. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (sigint_deliver() < 0) {
        core_chain_over(type, value, tb);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    if (reached < 0) return NULL;
    return PyBool_FromLong(reached);
}

/* turn() -> bool: the progress thread's turn, under the baton (waited for
 * without the GIL: a driver's turn or spin ends within a chunk). */
static PyObject *loop_turn(Loop *self, PyObject *unused) {
    if (cleared(self)) return NULL;
    if (!PyThread_acquire_lock(self->baton, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->baton, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    int busy = one_turn(self);
    PyThread_release_lock(self->baton);
    if (busy < 0) return NULL;
    return PyBool_FromLong(busy);
}

/* hand(to, driver=None, only_from=None) -> bool. */
static PyObject *loop_hand(Loop *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    if (cleared(self)) return NULL;
    static const char *const names[] = {"to", "driver", "only_from"};
    PyObject *a[3];
    if (core_parse("hand", names, 3, 1, args, nargs, kwnames, a) < 0) return NULL;
    int to = owner_index(self, a[0]);
    if (to < 0) return NULL;
    int only_from = -1;
    if (a[2] && a[2] != Py_None && (only_from = owner_index(self, a[2])) < 0) return NULL;
    unsigned long driver = 0;
    if (a[1] && a[1] != Py_None) {
        driver = PyLong_AsUnsignedLong(a[1]);
        if (PyErr_Occurred()) return NULL;
    }
    int moved = hand_to(self, to, driver, only_from);
    if (moved < 0) return NULL;
    return PyBool_FromLong(moved);
}

static PyObject *loop_decide(Loop *self, PyObject *const *args, Py_ssize_t nargs) {
    if (cleared(self)) return NULL;
    double now, idle;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decide() takes 2 arguments (now, idle_s)");
        return NULL;
    }
    if ((now = PyFloat_AsDouble(args[0])) == -1.0 && PyErr_Occurred()) return NULL;
    if ((idle = PyFloat_AsDouble(args[1])) == -1.0 && PyErr_Occurred()) return NULL;
    return decide(self, now, idle);
}

static PyObject *loop_yield(Loop *self, PyObject *now) {
    if (cleared(self)) return NULL;
    double t = PyFloat_AsDouble(now);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    if (yield_core(self, t) < 0) return NULL;
    Py_RETURN_NONE;
}

/* wake(force=False): make the loop turn again now if it sleeps (a few flag
 * tests when it does not): whoever waits in epoll or spins, or the
 * progress thread parked with no driver (lingering after one left). */
static PyObject *loop_wake(Loop *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[] = {"force"};
    PyObject *a[1];
    if (core_parse("wake", names, 1, 0, args, nargs, kwnames, a) < 0) return NULL;
    int force = a[0] ? PyObject_IsTrue(a[0]) : 0;
    if (force < 0) return NULL;
    if (self->sleeping || self->driver_sleeping || self->driver_spinning || force)
        poke(self->wake_fd);
    if (self->parked && (self->owner != DRIVER || force)) poke(self->park_fd);
    Py_RETURN_NONE;
}

/* nudge(): wake() for a send left in flight, which leaves a progress
 * thread lingering after a driver parked (progress.py says why). */
static PyObject *loop_nudge(Loop *self, PyObject *unused) {
    if (self->sleeping || self->driver_sleeping || self->driver_spinning) poke(self->wake_fd);
    if (self->parked && self->owner == THREAD) poke(self->park_fd);
    Py_RETURN_NONE;
}

/* deepen(seen) -> None: the parked thread's look found one drive (drives
 * was `seen` at the last look) still on: park deep. */
static PyObject *loop_deepen(Loop *self, PyObject *seen) {
    long long s = PyLong_AsLongLong(seen);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (self->owner == DRIVER && self->drives == s) self->park_deep = 1;
    Py_RETURN_NONE;
}

/* forget() -> None: the loop's descriptors are about to be closed: never
 * written again.  A wake-up after close (a caller's, racing the shutdown)
 * wrote to the number, which the process may have given to another file
 * meanwhile (another agent's wake descriptor, in a process that starts
 * RPC again). */
static PyObject *loop_forget(Loop *self, PyObject *unused) {
    self->wake_fd = self->park_fd = self->linger_fd = -1;
    Py_RETURN_NONE;
}

/* fired() -> None: the linger timer woke the parked thread. */
static PyObject *loop_fired(Loop *self, PyObject *unused) {
    self->linger_armed = 0;
    self->park_deep = 0;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------- the object */

static int loop_traverse(Loop *self, visitproc visit, void *arg) {
    for (int i = 0; i < NOWNERS; i++) Py_VISIT(self->owners[i]);
    Py_VISIT(self->progress);
    Py_VISIT(self->turn);
    Py_VISIT(self->expected);
    Py_VISIT(self->pending);
    Py_VISIT(self->quiet);
    Py_VISIT(self->spin);
    Py_VISIT(self->on_taken);
    Py_VISIT(self->sleep);
    Py_VISIT(self->on_error);
    Py_VISIT(self->strategy);
    Py_VISIT(self->awaited);
    Py_VISIT(self->polls);
    Py_VISIT(self->last_why);
    return 0;
}

static int loop_clear(Loop *self) {
    for (int i = 0; i < NOWNERS; i++) Py_CLEAR(self->owners[i]);
    Py_CLEAR(self->progress);
    Py_CLEAR(self->turn);
    Py_CLEAR(self->expected);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->quiet);
    Py_CLEAR(self->spin);
    Py_CLEAR(self->on_taken);
    Py_CLEAR(self->sleep);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->strategy);
    Py_CLEAR(self->awaited);
    Py_CLEAR(self->polls);
    Py_CLEAR(self->last_why);
    return 0;
}

static void loop_dealloc(Loop *self) {
    PyObject_GC_UnTrack(self);
    loop_clear(self);
    if (self->baton) PyThread_free_lock(self->baton);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *const loop_names[] = {
    "owners", "moves", "awaited", "polls", "progress", "turn", "expected", "pending",
    "quiet", "spin", "on_taken", "sleep", "on_error", "strategy", "wake_fd", "park_fd",
    "linger_fd", "spin_s", "spin_chunk_s", "linger_s", "sleep_s"};
#define NLOOP_NAMES ((Py_ssize_t)(sizeof loop_names / sizeof loop_names[0]))

static int as_fd(PyObject *o, int *fd) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *fd = (int)v;
    return 0;
}

static int as_seconds(PyObject *o, double *d) {
    *d = PyFloat_AsDouble(o);
    return *d == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* Loop(owners, moves, awaited, polls, *, progress, turn, expected,
 * pending, quiet, spin, on_taken, sleep, on_error, strategy, wake_fd,
 * park_fd, linger_fd, spin_s, spin_chunk_s, linger_s, sleep_s): `owners`
 * the Owner members in the order THREAD, DRIVER, LINGER, STOPPED, `moves`
 * the table {owner: owners it may move to}, `awaited` Why.AWAITED,
 * `polls` the set of Whys that poll; `spin` and `on_taken` may be None
 * (every idle turn a turn). */
static PyObject *loop_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *a[NLOOP_NAMES] = {0};
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs > NLOOP_NAMES) {
        PyErr_SetString(PyExc_TypeError, "Loop(): too many arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) a[i] = PyTuple_GET_ITEM(args, i);
    if (kwargs) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &key, &value)) {
            Py_ssize_t i = 0;
            for (; i < NLOOP_NAMES; i++)
                if (PyUnicode_CompareWithASCIIString(key, loop_names[i]) == 0) break;
            if (i == NLOOP_NAMES || a[i]) {
                PyErr_Format(PyExc_TypeError, "Loop(): unexpected or repeated argument '%U'",
                             key);
                return NULL;
            }
            a[i] = value;
        }
    }
    for (Py_ssize_t i = 0; i < NLOOP_NAMES; i++)
        if (!a[i]) {
            PyErr_Format(PyExc_TypeError, "Loop() missing argument '%s'", loop_names[i]);
            return NULL;
        }
    if (!PyTuple_Check(a[0]) || PyTuple_GET_SIZE(a[0]) != NOWNERS || !PyDict_Check(a[1]) ||
        !PyAnySet_Check(a[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "Loop(): owners is a tuple of 4, moves a dict, polls a set");
        return NULL;
    }
    Loop *self = (Loop *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    for (int i = 0; i < NOWNERS; i++) {
        self->owners[i] = PyTuple_GET_ITEM(a[0], i);
        Py_INCREF(self->owners[i]);
    }
    for (int i = 0; i < NOWNERS; i++) {
        PyObject *to = PyDict_GetItemWithError(a[1], self->owners[i]);
        if (!to) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "Loop(): no moves for %R", self->owners[i]);
            goto fail;
        }
        PyObject *it = PyObject_GetIter(to), *item;
        if (!it) goto fail;
        while ((item = PyIter_Next(it))) {
            int j = owner_index(self, item);
            Py_DECREF(item);
            if (j < 0) break;
            self->moves[i] |= 1u << j;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) goto fail;
    }
    PyObject **slots[] = {&self->awaited, &self->polls, &self->progress, &self->turn,
                          &self->expected, &self->pending, &self->quiet, &self->spin,
                          &self->on_taken, &self->sleep, &self->on_error, &self->strategy};
    for (int i = 0; i < 12; i++) {
        *slots[i] = a[2 + i];
        Py_INCREF(a[2 + i]);
    }
    if (as_fd(a[14], &self->wake_fd) < 0 || as_fd(a[15], &self->park_fd) < 0 ||
        as_fd(a[16], &self->linger_fd) < 0 || as_seconds(a[17], &self->spin_s) < 0 ||
        as_seconds(a[18], &self->spin_chunk_s) < 0 || as_seconds(a[19], &self->linger_s) < 0 ||
        as_seconds(a[20], &self->sleep_s) < 0)
        goto fail;
    if (self->spin != Py_None && self->on_taken == Py_None) {
        PyErr_SetString(PyExc_ValueError, "Loop(): a spin needs its on_taken");
        goto fail;
    }
    self->last_why = Py_None;
    Py_INCREF(Py_None);
    self->owner = THREAD;
    if (!(self->baton = PyThread_allocate_lock())) {
        PyErr_NoMemory();
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static PyObject *loop_get_owner(Loop *self, void *unused) {
    if (cleared(self)) return NULL;
    Py_INCREF(self->owners[self->owner]);
    return self->owners[self->owner];
}

static PyObject *loop_get_driver(Loop *self, void *unused) {
    if (!self->has_driver) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(self->driver);
}

static PyObject *loop_get_thread(Loop *self, void *unused) {
    if (!self->has_thread) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(self->thread_ident);
}

static int loop_set_thread(Loop *self, PyObject *value, void *unused) {
    if (!value || value == Py_None) {
        self->has_thread = 0;
        return 0;
    }
    unsigned long ident = PyLong_AsUnsignedLong(value);
    if (PyErr_Occurred()) return -1;
    self->thread_ident = ident;
    self->has_thread = 1;
    return 0;
}

static PyObject *loop_get_strategy(Loop *self, void *unused) {
    if (cleared(self)) return NULL;
    Py_INCREF(self->strategy);
    return self->strategy;
}

static PyGetSetDef loop_getset[] = {
    {"owner", (getter)loop_get_owner, NULL, "who turns the loop now (an Owner)", NULL},
    {"driver", (getter)loop_get_driver, NULL, "the driving thread's ident, or None", NULL},
    {"thread_ident", (getter)loop_get_thread, (setter)loop_set_thread,
     "the progress thread's ident (it never drives), or None before it runs", NULL},
    {"strategy", (getter)loop_get_strategy, NULL,
     "when to poll rather than sleep (the one given, for the loop's life)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMemberDef loop_members[] = {
    {"stopping", T_BOOL, offsetof(Loop, stopping), READONLY, "the owner is STOPPED"},
    {"driver_left", T_DOUBLE, offsetof(Loop, driver_left), READONLY,
     "when the last driver left (monotonic)"},
    {"drive_started", T_DOUBLE, offsetof(Loop, drive_started), READONLY,
     "when the current drive took the loop"},
    {"park_deep", T_INT, offsetof(Loop, park_deep), 0,
     "the parked thread sleeps through drives until the linger timer"},
    {"linger_armed", T_INT, offsetof(Loop, linger_armed), READONLY,
     "the linger timer is armed"},
    {"sleeping", T_INT, offsetof(Loop, sleeping), 0, "the progress thread waits in epoll"},
    {"parked", T_INT, offsetof(Loop, parked), 0, "the progress thread waits in its park"},
    {"driver_sleeping", T_INT, offsetof(Loop, driver_sleeping), READONLY,
     "a driver waits in epoll"},
    {"driver_spinning", T_INT, offsetof(Loop, driver_spinning), READONLY,
     "a driver spins natively"},
    {"drives", T_LONGLONG, offsetof(Loop, drives), READONLY, "drives begun"},
    {"driven_turns", T_LONGLONG, offsetof(Loop, driven_turns), READONLY,
     "turns taken by drivers"},
    {"spins", T_LONGLONG, offsetof(Loop, spins), READONLY, "native spins by drivers"},
    {"timer_sets", T_LONGLONG, offsetof(Loop, timer_sets), READONLY,
     "the linger timer armed or disarmed (two syscalls a drive would cost a call ~2 µs)"},
    {"last_why", T_OBJECT_EX, offsetof(Loop, last_why), 0, "decide()'s last answer"},
    {NULL, 0, 0, 0, NULL}};

static PyMethodDef loop_methods[] = {
    {"drive", (PyCFunction)loop_drive, METH_O,
     "drive(done) -> bool: turn the loop on this thread until done() (True) or nothing is "
     "expected (False); False at once where driving cannot help."},
    {"turn", (PyCFunction)loop_turn, METH_NOARGS,
     "turn() -> bool: the progress thread's turn under the baton; whether it did anything."},
    {"hand", (PyCFunction)(void (*)(void))loop_hand, METH_FASTCALL | METH_KEYWORDS,
     "hand(to, driver=None, only_from=None) -> bool: move the owner as the table allows."},
    {"decide", (PyCFunction)(void (*)(void))loop_decide, METH_FASTCALL,
     "decide(now, idle_s) -> Why: whether the next turn may poll, and why."},
    {"yield_", (PyCFunction)loop_yield, METH_O,
     "yield_(now): sched_yield, and tell the strategy how long it took."},
    {"wake", (PyCFunction)(void (*)(void))loop_wake, METH_FASTCALL | METH_KEYWORDS,
     "wake(force=False): make the loop turn again now if it sleeps."},
    {"nudge", (PyCFunction)loop_nudge, METH_NOARGS,
     "nudge(): wake() for a send in flight, leaving a lingering thread parked."},
    {"deepen", (PyCFunction)loop_deepen, METH_O,
     "deepen(seen): park deep if the drive seen at the last look is still on."},
    {"forget", (PyCFunction)loop_forget, METH_NOARGS,
     "forget(): the descriptors are about to be closed; never write them again."},
    {"fired", (PyCFunction)loop_fired, METH_NOARGS,
     "fired(): the linger timer woke the parked thread."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ucxrpc._core.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The progress loop's owner and a driver's turns (transport/loop/progress.py).",
    .tp_new = loop_new,
    .tp_dealloc = (destructor)loop_dealloc,
    .tp_traverse = (traverseproc)loop_traverse,
    .tp_clear = (inquiry)loop_clear,
    .tp_methods = loop_methods,
    .tp_members = loop_members,
    .tp_getset = loop_getset,
};

/* ------------------------------------------------- the guard functions */

int core_guard(void) {
    int outer = turning;
    turning = 1;
    return outer;
}

int core_unguard(int outer) {
    turning = outer;
    return outer ? 0 : sigint_deliver();
}

/* guard() -> bool: enter a section Ctrl-C must not cut in half; returns
 * what unguard() needs.  Nests. */
static PyObject *py_guard(PyObject *m, PyObject *unused) {
    return PyBool_FromLong(core_guard());
}

/* unguard(outer): leave it; the outermost one delivers a Ctrl-C held. */
static PyObject *py_unguard(PyObject *m, PyObject *outer) {
    int o = PyObject_IsTrue(outer);
    if (o < 0) return NULL;
    if (core_unguard(o) < 0) return NULL;
    Py_RETURN_NONE;
}

/* turning() -> bool: whether this thread is in a drive or a send. */
static PyObject *py_turning(PyObject *m, PyObject *unused) { return PyBool_FromLong(turning); }

/* turning_bind(guard): the process's SigintGuard, once. */
static PyObject *py_turning_bind(PyObject *m, PyObject *guard) {
    Py_INCREF(guard);
    Py_XSETREF(sigint_guard, guard);
    Py_RETURN_NONE;
}

PyMethodDef core_loop_methods[] = {
    {"guard", (PyCFunction)py_guard, METH_NOARGS,
     "guard() -> bool: enter a section Ctrl-C must not cut in half (nests)."},
    {"unguard", (PyCFunction)py_unguard, METH_O,
     "unguard(outer): leave it; the outermost one delivers a Ctrl-C held meanwhile."},
    {"turning", (PyCFunction)py_turning, METH_NOARGS,
     "turning() -> bool: whether this thread drives the loop or sends."},
    {"turning_bind", (PyCFunction)py_turning_bind, METH_O,
     "turning_bind(guard): the SigintGuard guard() and drives hold Ctrl-C for."},
    {NULL, NULL, 0, NULL}};

int core_loop_init(PyObject *module) {
    if (!(str_held = PyUnicode_InternFromString("held")) ||
        !(str_deliver = PyUnicode_InternFromString("deliver")) ||
        !(str_blocked_until = PyUnicode_InternFromString("blocked_until")) ||
        !(str_refusal = PyUnicode_InternFromString("refusal")) ||
        !(str_late_s = PyUnicode_InternFromString("late_s")) ||
        !(str_spun = PyUnicode_InternFromString("spun")) ||
        !(str_yielded = PyUnicode_InternFromString("yielded")))
        return -1;
    if (PyType_Ready(&LoopType) < 0) return -1;
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(module, "Loop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(&LoopType);
        return -1;
    }
    return 0;
}
