"""The thread pool that runs user functions for incoming RPCs.

torch's fixed pool deadlocks once every thread blocks in a nested call back
to the caller.  Here a thread that blocks in an RPC wait is not counted
against ``size``: the pool may start another so queued work keeps flowing,
while ``size`` threads at most are runnable at once.

Work queued behind a running thread waits for it, not for a new thread:
with the GIL, a second thread running Python code adds no throughput, only
hand-offs.  A watchdog (as Go's sysmon retakes a processor from a blocked
system call, or .NET's pool injects threads when none completes work)
starts one more thread when queued work has seen no task taken for a
:data:`WATCH_WINDOW_S` window in which the process idled: the running threads are
then blocked in user code (a sleep, a lock, I/O), and the next request must
not wait for them, as torch's pool would not make it.

A process that is merely not scheduled (another process, or the caller
beside it on a 2-core host, has the cores) also uses little CPU in the
window, yet its running thread is not blocked: one more thread would only
queue for the core with it.  So an idle-looking window is confirmed by a
second one that counts the time the process's threads spent runnable,
waiting for a core, as well as running (the kernel's schedstat).  Beside
one or two busy processes, a 6 s burst of ``rpc_async`` calls saw 17-50
stalls with the CPU test alone, and the callee grew 3-16 pool threads; with
the second window, 1-4 stalls and 2-4 threads, at the same throughput
(benchmarks/runs/AF.md).  A real stall now waits two windows.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

from .._core import Expect

logger = logging.getLogger(__name__)

#: The watchdog's window: queued work that saw no task taken for two such
#: windows, in which the process ran less than IDLE_SHARE of a core (the
#: second one counting time it waited for a core as running), gets another
#: thread.  It costs one watchdog wake-up per window while work is queued.
WATCH_WINDOW_S = 0.002
IDLE_SHARE = 0.5
#: ... and queued work waits no longer than this whatever the process did
#: (a user function may hold the GIL computing: torch's pool would run the
#: next request beside it).
STALL_MAX_S = 0.05

_local = threading.local()
#: The calling thread's state as a pool's thread: ``this_thread.pool`` is
#: the pool it belongs to (absent on any other thread), for a caller that
#: asks every call without a Python call (``getattr(this_thread, "pool",
#: None) is pool``, as :meth:`WorkerPool.owns_this_thread`; issue 52).
this_thread = _local
_STOP = object()


def stalled(window_s: float, busy_s: float, waited_s: float) -> bool:
    """The watchdog's verdict on queued work that saw no task taken in a
    window of ``window_s``, in which the process ran or waited for a core
    for ``busy_s`` (its threads' sum), and that has waited ``waited_s``
    since the last task was taken."""
    return busy_s < IDLE_SHARE * window_s or waited_s >= STALL_MAX_S


class RunQueueClock:
    """Seconds the process's Python threads (but the reader) have spent
    runnable but not running, waiting for a core, summed: the second field
    of ``/proc/self/task/<tid>/schedstat``.  A thread waiting for the GIL
    sleeps on a lock, so it is not counted, but the GIL's holder is.

    Where the kernel does not say (no schedstats; a sandbox) :meth:`read`
    returns 0.0 throughout, and the watchdog falls back on CPU time alone.
    Files stay open per thread: opening, reading and closing one cost
    ~10 µs here, reading it again ~2 µs.
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self.works = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")

    def read(self) -> float:
        if not self.works:
            return 0.0
        me = threading.get_native_id()
        tids = {t.native_id for t in threading.enumerate() if t.native_id not in (me, None)}
        for gone in self._fds.keys() - tids:
            os.close(self._fds.pop(gone))
        total = 0
        for tid in tids:
            fd = self._fds.get(tid)
            try:
                if fd is None:
                    fd = self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat",
                                                  os.O_RDONLY)
                total += int(os.pread(fd, 64, 0).split()[1])
            except (OSError, ValueError, IndexError):
                # The thread ended meanwhile; its id, if reused, is opened
                # afresh next time.
                if (fd := self._fds.pop(tid, None)) is not None:
                    os.close(fd)
        return total / 1e9

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class WorkerPool:
    """Lazily grown pool; ``size`` bounds runnable (non-blocked) threads.

    A submit wakes a sleeping thread (or starts one) only when no thread
    runs a task, or is on its way to the queue: a running thread takes the
    next task when it ends.  A frame of 60 requests used to wake a thread
    per request, each then queueing for the GIL and the pipe's lock (the
    callee of an ``rpc_async`` burst ran 40% faster with 2 threads than
    16).  Work left waiting while every running thread is stuck gets a new
    thread from the watchdog (module docstring); a thread that blocks in an
    RPC wait (:meth:`blocking`) gets the next one started at once.

    Args:
        on_quiet: called when no pool thread is left running Python code
            (all idle or waiting on the network): the transport may poll again.
        idle_wait: ``idle_wait(has_work)``, called by a thread that finished
            a task and found none queued, before it blocks for the next one:
            the transport may progress on that thread while polling pays, so
            a request arriving meanwhile runs where it landed instead of
            waking another thread.
        run_queue: makes the watchdog's :class:`RunQueueClock` (on its
            thread).
    """

    def __init__(self, size: int, name: str = "ucxrpc-worker",
                 on_quiet: Callable[[], None] | None = None,
                 idle_wait: Callable[[Callable[[], bool]], None] | None = None,
                 run_queue: Callable[[], RunQueueClock] = RunQueueClock) -> None:
        if size < 1:
            raise ValueError(f"num_worker_threads must be positive, got {size}")
        self.size = size
        self._name = name
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._tasks: collections.deque[Any] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._sleeping = 0  # threads waiting on _ready
        self._waking = 0    # threads woken or started and not yet at the queue
        self._blocked = 0
        self._active = 0  # tasks submitted and not finished
        #: _active less _blocked, kept beside them under the lock: above 0
        #: while Python code runs or is about to run on a pool thread
        #: (:meth:`computing`).  A plain attribute, which the loop's
        #: polling policy reads every idle turn (issue 52).
        self.running = 0
        self._closed = False
        self._taken_at = 0.0  # when a thread last took a task
        self._watchdog: threading.Thread | None = None
        self._watch = threading.Condition(self._lock)
        self._watch_idle = False  # the watchdog waits for work, untimed
        self.stalls = 0  # threads the watchdog woke or started
        self.on_quiet = on_quiet
        self._idle_wait = idle_wait
        #: Whether there is work for the thread driving in idle_wait: a task
        #: it claimed (its own _local.task), one queued, or the pool closed.
        #: Rules the native core reads (csrc/expect.c): a drive asks at each
        #: turn, a Python call each as a method (issue 52).
        self._has_work = Expect((("any", ((_local, "task"), self._tasks, (self, "_closed")), True),
                                 ("then", False)))
        self._run_queue_clock = run_queue

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if getattr(_local, "waiting", None) is self and _local.task is None:
            # Submitted by a pool thread in idle_wait (it progressed the
            # transport and the request landed here): it runs it next, and
            # no other thread is woken for it.
            _local.task = (fn, args)
            with self._lock:
                self._active += 1
                self.running += 1
                self._taken_at = time.monotonic()
                # A second request landing in the same turn is queued: this
                # thread takes it next, or the watchdog starts another if
                # this one blocks (it must not wait behind a long call).
                _local.waiting = None
            return
        with self._lock:
            self._tasks.append((fn, args))
            self._active += 1
            self.running += 1
            if self._active - len(self._tasks) <= self._blocked:
                self._wake_one()  # no thread runs a task: none would come for it
            elif self._watch_idle or self._watchdog is None:
                # (the watchdog watches already otherwise: in a burst, every
                # request but the first; a call fewer each, issue 52)
                self._arm_watchdog()

    def _arm_watchdog(self) -> None:
        """Have the watchdog look at the queue (lock held; work is queued)."""
        if self._watch_idle:
            self._watch_idle = False
            self._watch.notify()
        elif self._watchdog is None and not self._closed:
            self._watchdog = threading.Thread(target=self._watch_loop,
                                              name=f"{self._name}-watchdog", daemon=True)
            self._watchdog.start()

    def _watch_loop(self) -> None:
        """Get a thread for queued work that no running thread came for
        within a window of WATCH_WINDOW_S while the process idled (its running
        threads are blocked in user code), or within STALL_MAX_S whatever
        it did.  A busy process with work queued is starved, not stuck:
        its threads wait for the GIL or a core, and one more thread would
        only wait with them.  A window that idled by CPU time is confirmed
        by a second that counts waiting for a core too (module docstring);
        the run queue is read only then, as it costs a read per thread."""
        clock = self._run_queue_clock()
        confirming = False  # the last window idled by CPU time alone
        try:
            with self._lock:
                while not self._closed:
                    if not self._tasks:
                        confirming = False
                        self._watch_idle = True
                        self._watch.wait()  # _arm_watchdog notifies
                        continue
                    start = time.monotonic()
                    queued = self._read_unlocked(clock) if confirming else 0.0
                    # The window from after that read, and the run queue's
                    # over more than it: a pause of this thread in between
                    # (the reads release the lock) counts as busy, not idle.
                    begin, cpu = time.monotonic(), time.process_time()
                    self._watch.wait(WATCH_WINDOW_S)
                    if not self._tasks or self._taken_at >= start:
                        confirming = False
                        continue  # work moves
                    now = time.monotonic()
                    used = time.process_time() - cpu
                    if confirming:
                        # (a thread that ended meanwhile takes its total
                        # with it: never less than nothing)
                        used += max(0.0, self._read_unlocked(clock) - queued)
                    waited = now - self._taken_at
                    verdict = stalled(now - begin, used, waited)
                    if verdict and not confirming and clock.works and waited < STALL_MAX_S:
                        confirming = True
                        continue
                    confirming = False
                    if verdict and self._wake_one():
                        self.stalls += 1
                        # The woken thread gets its own bound to reach the queue.
                        self._taken_at = now
        finally:
            clock.close()

    def _read_unlocked(self, clock: RunQueueClock) -> float:
        """``clock.read()`` without the lock (lock held on entry and exit):
        a submit need not wait for the reads."""
        self._lock.release()
        try:
            return clock.read()
        finally:
            self._lock.acquire()

    def _wake_one(self) -> bool:
        """Get a thread to the queue, unless one is on its way or ``size``
        run (lock held); whether it did."""
        if self._waking or self._closed:
            return False
        if self._sleeping:
            self._waking += 1
            self._ready.notify()
            return True
        if len(self._threads) - self._blocked < self.size:
            t = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads)}",
                                 daemon=True)
            self._threads.append(t)
            self._waking += 1
            t.start()
            return True
        return False

    def _loop(self) -> None:
        _local.pool = self
        _local.task = None
        arriving = True  # started by _wake_one: counted in _waking
        while True:
            item = self._next(arriving)
            if item is _STOP:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:
                logger.exception("unhandled error in an RPC worker thread")
            # Not held while waiting for the next item: arguments may pin
            # pooled receive buffers.
            del item, fn, args
            with self._lock:
                self._active -= 1
                self.running -= 1
                quiet = self._active == self._blocked
                # On its way to the queue (or to idle_wait), as a thread just
                # woken is: a request the progress thread queues meanwhile
                # waits for this thread, not for one more.  Counted off
                # here, in that window every such request found no thread
                # running a task and none coming, and woke a sleeping thread
                # or started a new one; a callee's pool grew to six threads
                # in rpc_async bursts, all contending for the GIL (Run BB).
                self._waking += 1
            arriving = True
            # A thread about to wait in idle_wait polls (or wakes the
            # transport) itself.
            if quiet and (self._idle_wait is None or self._tasks):
                self._quiet()

    def _next(self, arriving: bool = False) -> Any:
        """The next task: one this thread claimed in idle_wait (see submit),
        else the queue's next.  A thread ``arriving`` (just started) stops
        counting as on its way in the same hold of the lock that takes its
        task: counted off before, it let a submit in between see no thread
        coming for the queue and start a second one."""
        if self._idle_wait is not None and not self._tasks and not self._closed:
            if arriving:
                with self._lock:
                    self._waking -= 1
                arriving = False
            _local.waiting = self
            try:
                self._idle_wait(self._has_work)
            finally:
                _local.waiting = None
            task, _local.task = _local.task, None
            if task is not None:
                return task
        with self._lock:
            if arriving:
                self._waking -= 1
            while not self._tasks:
                self._sleeping += 1
                self._ready.wait()
                self._sleeping -= 1
                self._waking -= 1  # every wake-up is counted by its waker
            item = self._tasks.popleft()
            self._taken_at = time.monotonic()
            if self._tasks and (self._watch_idle or self._watchdog is None):
                self._arm_watchdog()  # queued in a burst that woke only this thread
            return item

    def computing(self) -> bool:
        """Whether Python code is running or about to run on a pool thread
        (counted from submit: the thread taking a task needs the GIL too)."""
        return self.running > 0

    def _quiet(self) -> None:
        hook = self.on_quiet
        if hook is not None:
            hook()

    def owns_this_thread(self) -> bool:
        """Whether the calling thread is one of this pool's."""
        return getattr(_local, "pool", None) is self

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark the calling pool thread as waiting on the network."""
        if getattr(_local, "pool", None) is not self:
            yield
            return
        with self._lock:
            self._blocked += 1
            self.running -= 1
            if self._tasks:
                self._wake_one()  # work queued behind this thread goes on
            quiet = self._active == self._blocked
        if quiet:
            self._quiet()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1
                self.running += 1

    def pending(self) -> int:
        return len(self._tasks)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every thread after the queued work; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            self._tasks.extend(_STOP for _ in threads)
            self._waking += self._sleeping
            self._ready.notify_all()
            self._watch.notify()
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(timeout)
