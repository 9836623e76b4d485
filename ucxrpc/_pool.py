"""The thread pool that runs user functions for incoming RPCs.

torch's fixed pool deadlocks once every thread blocks in a nested call back
to the caller.  Here a thread that blocks in an RPC wait is not counted
against ``size``: the pool may start another so queued work keeps flowing,
while ``size`` threads at most are runnable at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

_local = threading.local()
_STOP = object()


class WorkerPool:
    """Lazily grown pool; ``size`` bounds runnable (non-blocked) threads.

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
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
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
                # No longer idle: it runs this next.  Counted idle, it made
                # a second request landing in the same turn wait behind the
                # first instead of starting a thread (a slow call then held
                # up every call queued behind it).
                self._idle -= 1
            return
        self._queue.put((fn, args))
        with self._lock:
            self._active += 1
            if self._idle == 0:
                self._maybe_spawn()

    def _maybe_spawn(self) -> None:
        if self._closed or len(self._threads) - self._blocked >= self.size:
            return
        t = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads)}",
                             daemon=True)
        self._threads.append(t)
        self._idle += 1  # counted idle until it takes its first item
        t.start()

    def _loop(self) -> None:
        _local.pool = self
        _local.task = None
        while True:
            item, claimed = self._next()
            if not claimed:  # a claimed task was uncounted at submit
                with self._lock:
                    self._idle -= 1
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
                self._idle += 1
                self._active -= 1
                quiet = self._active == self._blocked
            # A thread about to wait in idle_wait polls (or wakes the
            # transport) itself.
            if quiet and (self._idle_wait is None or not self._queue.empty()):
                self._quiet()

    def _next(self) -> tuple[Any, bool]:
        """The next item, and whether it is a task this thread claimed in
        idle_wait (see submit)."""
        if self._idle_wait is not None and self._queue.empty() and not self._closed:
            _local.waiting = self
            try:
                self._idle_wait(self._has_work)
            finally:
                _local.waiting = None
            task, _local.task = _local.task, None
            if task is not None:
                return task, True
        return self._queue.get(), False

    def _has_work(self) -> bool:
        return _local.task is not None or not self._queue.empty() or self._closed

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
            if self._idle == 0 and not self._queue.empty():
                self._maybe_spawn()
            quiet = self._active == self._blocked
        if quiet:
            self._quiet()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 5.0) -> None:
        """Stop every thread after the queued work; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(_STOP)
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(timeout)
