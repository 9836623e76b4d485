"""The thread pool that runs user functions for incoming RPCs.

torch's fixed pool deadlocks once every thread blocks in a nested call back
to the caller.  Here a thread that blocks in an RPC wait is not counted
against ``size``: the pool may start another so queued work keeps flowing,
while ``size`` threads at most are runnable at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

_local = threading.local()
_STOP = object()


class WorkerPool:
    """Lazily grown pool; ``size`` bounds runnable (non-blocked) threads.

    Wake-ups are passed on, one at a time: a submit wakes one sleeping
    thread (or starts one) only when no thread is already on its way to the
    queue, and a thread that takes a task and leaves more behind wakes the
    next.  A frame of 60 requests used to wake every idle thread at once,
    one futex each, all then queueing for the GIL and the pipe's lock (the
    callee of an ``rpc_async`` burst ran 40% faster with 2 threads than 16).
    A task whose thread blocks still gets the next one started, through the
    same hand-on.

    Args:
        on_quiet: called when no pool thread is left running Python code
            (all idle or waiting on the network): the transport may poll again.
        idle_wait: ``idle_wait(has_work)``, called by a thread that finished
            a task and found none queued, before it blocks for the next one:
            the transport may progress on that thread while polling pays, so
            a request arriving meanwhile runs where it landed instead of
            waking another thread.
    """

    def __init__(self, size: int, name: str = "ucxrpc-worker",
                 on_quiet: Callable[[], None] | None = None,
                 idle_wait: Callable[[Callable[[], bool]], None] | None = None) -> None:
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
        self._closed = False
        self.on_quiet = on_quiet
        self._idle_wait = idle_wait

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if getattr(_local, "waiting", None) is self and _local.task is None:
            # Submitted by a pool thread in idle_wait (it progressed the
            # transport and the request landed here): it runs it next, and
            # no other thread is woken for it.
            _local.task = (fn, args)
            with self._lock:
                self._active += 1
                # A second request landing in the same turn wakes another
                # thread (_wake_one): it must not wait behind this one.
                _local.waiting = None
            return
        with self._lock:
            self._tasks.append((fn, args))
            self._active += 1
            self._wake_one()

    def _wake_one(self) -> None:
        """Get a thread to the queue, unless one is on its way (lock held)."""
        if self._waking or self._closed:
            return
        if self._sleeping:
            self._waking += 1
            self._ready.notify()
        elif len(self._threads) - self._blocked < self.size:
            t = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads)}",
                                 daemon=True)
            self._threads.append(t)
            self._waking += 1
            t.start()

    def _loop(self) -> None:
        _local.pool = self
        _local.task = None
        with self._lock:
            self._waking -= 1  # started by _wake_one
        while True:
            item = self._next()
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
                quiet = self._active == self._blocked
            # A thread about to wait in idle_wait polls (or wakes the
            # transport) itself.
            if quiet and (self._idle_wait is None or self._tasks):
                self._quiet()

    def _next(self) -> Any:
        """The next task: one this thread claimed in idle_wait (see submit),
        else the queue's next."""
        if self._idle_wait is not None and not self._tasks and not self._closed:
            _local.waiting = self
            try:
                self._idle_wait(self._has_work)
            finally:
                _local.waiting = None
            task, _local.task = _local.task, None
            if task is not None:
                return task
        with self._lock:
            while not self._tasks:
                self._sleeping += 1
                self._ready.wait()
                self._sleeping -= 1
                self._waking -= 1  # every wake-up is counted by its waker
            item = self._tasks.popleft()
            if self._tasks:
                self._wake_one()  # pass it on: more work than this thread
            return item

    def _has_work(self) -> bool:
        return _local.task is not None or bool(self._tasks) or self._closed

    def computing(self) -> bool:
        """Whether Python code is running or about to run on a pool thread
        (counted from submit: the thread taking a task needs the GIL too)."""
        return self._active > self._blocked

    def _quiet(self) -> None:
        hook = self.on_quiet
        if hook is not None:
            hook()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark the calling pool thread as waiting on the network."""
        if getattr(_local, "pool", None) is not self:
            yield
            return
        with self._lock:
            self._blocked += 1
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
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(timeout)
