"""The calls this worker made and waits for: their futures, by message id
and by peer, and their deadlines.

Thread-safety: every method may be called from any thread.  The table
itself is native and has no lock (``_core.Calls``, csrc/calls.c: each of
its calls is one step under the GIL; of several threads taking one call
out, one gets it).  A future is completed outside the timer's condition,
since its callbacks may make calls.

Where a future completes: completing one runs its callbacks on the
completing thread, and replies land inside a transport turn (the progress
thread's, or a driving caller's), which runs under the transport's baton.
A callback that waits there for another call's reply waits for the turn it
is blocking.  So a :class:`CallFuture` that code hooked a callback onto
(``then``, ``add_done_callback``) is completed on the table's callback
pool, as torch's agent completes every future on its thread pool; the
others complete where the reply lands, without a thread hand-off.  Timeouts
and failed peers follow the same rule (the timer thread is not blocked by
a callback either).

An ``rpc_sync`` call's reply goes to a :class:`SyncReply` instead: nobody
but its caller ever sees it, so it needs none of a torch Future's
machinery.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import torch

from .. import _torch_futures
from .._core import Calls, Reply
from .pool import WorkerPool
from .remote_errors import timeout_error

__all__ = ["Call", "CallFuture", "CallTable", "SyncReply"]


#: Decides, for every :class:`CallFuture`, between completing it inline and
#: on the callback pool, against a callback being hooked on meanwhile.  One
#: lock for all futures: it guards a flag and a table entry, never code
#: that runs.
#: A lock of each future's own (and the instance dict its flag needed) were
#: two more objects per call for the cyclic garbage collector to walk: a
#: burst of rpc_async calls held 3 tracked objects a future, and full
#: collections took a tenth of the caller's time (benchmarks/runs/V.md).
_hooks = threading.Lock()
#: Futures being completed inline now (by id): the completing thread, and
#: the event a thread that hooked a callback on meanwhile waits for (None
#: while nobody does).
_settling: dict[int, tuple[int, threading.Event | None]] = {}


#: torch._C.Future's constructor (CallFuture.__init__).
_future_init = torch._C.Future.__init__
#: torch._C.Future's set_result: what torch.futures.Future's Python method
#: calls, without it (CallTable.complete).
_set_result = torch._C.Future.set_result
_get_ident = threading.get_ident


class CallFuture(torch.futures.Future):
    """The future of a call: a ``torch.futures.Future`` that notes whether a
    callback was hooked onto it (see the module's docstring), and whose
    ``wait()`` and ``value()`` raise a copy of its error, so that a failed
    call does not keep its waiter's frames (its arguments) alive for good
    (see ``_torch_futures.failure``)."""

    _hooked = False  # a class default: an instance gets a dict only when hooked

    def __init__(self, devices: Sequence[torch.device] = ()) -> None:
        # CUDA-aware where the caller has devices, as devices.future makes.
        # torch's C constructor itself, without torch.futures.Future's
        # Python one and its list comprehension (two Python calls every
        # rpc_async; issue 52).
        _future_init(self, list(devices))

    def wait(self) -> Any:
        try:
            return super().wait()
        except Exception as exc:
            error = _torch_futures.detach(exc, sys._getframe())
        raise error

    def value(self) -> Any:
        try:
            return super().value()
        except Exception as exc:
            error = _torch_futures.detach(exc, sys._getframe())
        raise error

    def then(self, callback: Callable[[Any], Any]) -> Any:
        self._hook()
        return super().then(callback)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._hook()
        super().add_done_callback(callback)

    def _hook(self) -> None:
        """Note a callback hooked on.  A future being completed inline right
        now is waited for: the callback then runs on this thread, as on any
        done future, and never in the transport's turn."""
        with _hooks:
            self._hooked = True
            key = id(self)
            entry = _settling.get(key)
            if entry is None:
                return
            completer, event = entry
            if completer == threading.get_ident():
                # From a callback the completion runs (one chained in C++, as
                # wait_all's): the value is set, and waiting would never end.
                return
            if event is None:
                event = threading.Event()
                _settling[key] = (completer, event)
        event.wait()

    # (Completed by CallTable.complete, which claims it for an inline
    # completion in _settling itself: see _hook.)


# Its wait() differs from torch's only for a failed call (it raises a copy):
# wait_all, which has seen every future succeed, waits on it in C.
_torch_futures.PLAIN_WAITS.add(CallFuture)


#: Where an ``rpc_sync`` call's reply lands: its caller drives the loop
#: until it is done, then takes it with ``wait()`` (the value, or raises the
#: call's error; blocks until there is one).  Creating, completing and
#: polling a torch Future cost ~5 µs a call, a tenth of a no-op round trip;
#: this class in Python four calls a call.  So it is the native core's
#: (``_core.Reply``, csrc/reply.c): ``done()``, ``set_result``,
#: ``set_exception``, ``wait()``, ``kept`` (what the call's arguments need
#: held until it is answered: :meth:`.core.RpcAgent.keep_until_answered`);
#: called, it says whether it is done, and a drive reads that flag without
#: a call.  Host-only workers without call wrappers: a CUDA worker's replies
#: need a CUDA-aware Future, and a wrapper (distributed autograd's) chains
#: onto a real one.
SyncReply = Reply


class Call(NamedTuple):
    """A call taken out of the table (:meth:`CallTable.pop`)."""

    future: torch.futures.Future | SyncReply
    peer: int
    #: Waited for at once by the caller (``rpc_sync``): no user callback can
    #: be on its future, which completes inline.
    waited: bool = False


class CallTable:
    """Outstanding calls, and the thread that fails them at their deadline.

    The table itself is native (``_core.Calls``, csrc/calls.c: one C call
    to add a call with its deadline, one to take it out, issue 52); here is
    what it means: completing futures, the timer thread, the callback pool.

    Args:
        name: the worker's name, for thread names.
        callback_threads: most threads running hooked futures' callbacks at
            once (started as needed).
    """

    def __init__(self, name: str, callback_threads: int = 16) -> None:
        self._callbacks = WorkerPool(callback_threads, name=f"ucxrpc-callbacks-{name}")
        # A call's future, and its peer and whether it is waited for, by
        # message id; its id in its peer's set; its deadline in the FIFO of
        # its timeout value (sorted for free: a deque append per call
        # instead of a heap push, now an array's in C).  No Call object per
        # entry: an object per outstanding call that outlives the young
        # collections is one more the cyclic garbage collector walks in full
        # collections (see Server.accept); a future is the only one each
        # call needs.
        self._table = Calls(Call)
        #: The outstanding calls by message id: read it, never write it.
        #: Its truth is "a call is in flight", which the loop's polling
        #: policy reads every idle turn, without a call (issue 52).
        self.by_id: dict[int, torch.futures.Future | SyncReply] = self._table.by_id
        # pop is the table's own, bound over the method: every reply takes
        # its call out, a Python call fewer each (issue 52).
        self.pop = self._table.pop  # type: ignore[method-assign]
        self._timer_cv = threading.Condition()
        self._closed = False
        self._timer = threading.Thread(target=self._expire, name=f"ucxrpc-timeouts-{name}",
                                       daemon=True)
        self.timeouts = 0

    def __len__(self) -> int:
        return len(self.by_id)

    def start(self) -> None:
        self._timer.start()

    def add(self, msg_id: int, future: torch.futures.Future | SyncReply, peer: int,
            waited: bool = False, timeout: float | None = None) -> None:
        """Put call ``msg_id`` in the table, failed with torch's timeout
        error in ``timeout`` s unless answered first (None: never)."""
        if self._table.add(msg_id, future, peer, waited, timeout):
            self._tell_timer()

    def arm(self, msg_id: int, timeout: float) -> None:
        """Fail call ``msg_id``, added without a timeout, with torch's
        timeout error in ``timeout`` s, unless it is answered first."""
        if self._table.arm(msg_id, timeout):
            self._tell_timer()

    def _tell_timer(self) -> None:
        # A deadline went into an empty FIFO: the timer thread may be
        # waiting with nothing queued, for as long as it takes.
        with self._timer_cv:
            self._timer_cv.notify()

    def armed(self) -> int:
        """Deadlines held (answered calls' entries included until dropped)."""
        return self._table.armed()

    def pop(self, msg_id: int) -> Call | None:
        """Take call ``msg_id`` out (None: answered, failed or timed out);
        of several threads taking one call out, one gets it."""
        return self._table.pop(msg_id)

    def fail(self, msg_id: int, exc: BaseException) -> None:
        call = self._table.pop(msg_id)
        if call is not None:
            self.complete(call, exc=exc)

    def fail_peer(self, peer: int, exc: BaseException) -> None:
        """Fail every call waiting on ``peer``."""
        for msg_id in self._table.take_peer(peer):
            self.fail(msg_id, exc)

    def close(self, exc: BaseException) -> None:
        """Stop the timer and fail what is left with ``exc``; idempotent."""
        self._closed = True
        with self._timer_cv:
            self._timer_cv.notify()
        for msg_id in list(self.by_id):
            self.fail(msg_id, exc)
        self._callbacks.close()

    def complete(self, call: Call, value: Any = None, exc: BaseException | None = None) -> None:
        """Complete ``call``'s future with ``value``, or fail it with ``exc``:
        here, or on the callback pool where a callback was hooked on."""
        fut = call.future
        if isinstance(fut, CallFuture) and not call.waited and not self._closed:
            # Inline unless a callback was hooked on: claimed in _settling
            # under _hooks, against a callback hooked on meanwhile, which
            # then waits for the completion (CallFuture._hook).  (The claim,
            # the settling and its end written out here, not as methods:
            # four Python calls every rpc_async reply; issue 52.)
            with _hooks:
                hooked = fut._hooked
                if not hooked:
                    key = id(fut)
                    _settling[key] = (_get_ident(), None)
            if hooked:
                self._callbacks.submit(_settle, fut, value, exc)
                return
            try:
                if exc is None:
                    _set_result(fut, value)
                else:
                    fut.set_exception(exc)
            finally:
                with _hooks:
                    _, event = _settling.pop(key)
                if event is not None:
                    event.set()
            return
        if exc is None:  # (_settle, inline: every rpc_sync reply comes here)
            fut.set_result(value)
        else:
            fut.set_exception(exc)

    def _expire(self) -> None:
        """Fail calls whose deadline passed (the native table finds them,
        and forgets answered ones' entries: at 20k calls/s with the 60 s
        default, over a million would wait for their deadline)."""
        while not self._closed:
            with self._timer_cv:
                expired, wait = self._table.expire(time.monotonic())
                # (wait None: no deadline queued; add() or close() tells us.
                # close() sets _closed before it takes the lock to notify.)
                if not expired and not self._closed:
                    self._timer_cv.wait(wait)
            # Failed outside the lock: a future's callbacks may make calls.
            for msg_id, timeout in expired:
                call = self._table.pop(msg_id)
                if call is not None:
                    self.timeouts += 1
                    self.complete(call, exc=timeout_error(timeout))


def _settle(fut: torch.futures.Future | SyncReply, value: Any,
            exc: BaseException | None) -> None:
    """Complete ``fut`` (a hooked one, on the callback pool)."""
    if exc is None:
        fut.set_result(value)
    else:
        fut.set_exception(exc)
