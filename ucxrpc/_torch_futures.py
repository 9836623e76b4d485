"""``torch.futures.wait_all`` and ``collect_all`` that fail as soon as one
future fails, and reads of a failed future that keep nothing alive.

torch documents both as exiting early when one of the futures fails, and its
own RPC's futures do: its C++ agent fails them with a C++ error, which its
C++ ``collectAll`` looks for.  A future failed from Python cannot carry one:
``torch.futures.Future.set_exception`` (the only public way, and how ucxrpc
fails a call) completes it with the exception as its *value*, raised by an
unwrap function on ``wait()``, and the one Python path to a C++ error (an
exception in a ``then()`` callback) turns it into a RuntimeError, losing the
remote exception's type.  So ``torch.futures.wait_all([slow, failed])``
waited for the slow one (until its RPC timeout, whose error then came out
first), where torch's RPC raises the failed one's error at once, with its
own type (torch's ``test_wait_all_exit_early_*``).

:func:`install` (run by ``init_rpc``) puts :func:`wait_all` and
:func:`collect_all` in torch.futures' place: the same contract, and the same
result for futures that never fail, watching each future with a done
callback and ending at the first that fails, however it was failed.  It is
the one place ucxrpc replaces a torch function; idempotent, and left in
place after ``shutdown`` (it serves any future as torch's does).

:func:`failure` and :func:`result` read a future's outcome without leaking
what reads it.  A failed ``torch.futures.Future`` raises the very exception
object it holds, on every ``wait()`` or ``value()``, and each raise prepends
the frames it passes through to that object's traceback.  The future holds
the object from C++, where Python's garbage collector cannot see it, so a
frame that both holds the future (or something holding it: an RRef, a
watcher) and appears in that traceback is a cycle the collector never
frees: every failed ``rpc_sync``, ``to_here`` or failed ``remote()`` kept
its callers' frames, their arguments and the RRef alive for good (its owner
never freed the value), and a future waited on in a loop grew its
traceback without end.  ucxrpc's own waits therefore go through these two,
and a call's future (``agent.calls.CallFuture``) raises copies from its
``wait()`` and ``value()`` too; a plain torch future (from its ``then()``)
behaves as torch's own, which has the same property.
"""

from __future__ import annotations

import copy
import sys
import threading
from types import CodeType, TracebackType
from typing import Any, Callable

import torch

__all__ = ["PLAIN_WAITS", "collect_all", "detach", "fail", "failure", "forward", "install",
           "result", "wait_all"]

_Future = torch.futures.Future
_CFuture = torch._C.Future
_add_done_callback = _CFuture.add_done_callback
_is_done = _CFuture.done
#: torch's C wait, without torch.futures.Future's Python method (which
#: only calls it): a call fewer per future waited on (issue 52).
_c_wait = _CFuture.wait

#: Future types whose ``wait()`` is torch's own for a future that did not
#: fail: :func:`wait_all` waits on them in C once it has seen every one
#: succeed.  ucxrpc's call futures (agent/calls.py) add themselves.
PLAIN_WAITS: set[type] = {_Future}


def _unwrap_codes() -> frozenset[CodeType]:
    """The code of the frames torch's Python side adds to a raise from a
    failed future's ``wait()`` or ``value()`` (its wrappers and its unwrap
    function: which, depends on torch's version, so they are found by
    raising one here, where the traceback's other entries are known)."""
    codes: set[CodeType] = set()
    fut: Any = _Future()
    fut.set_exception(ValueError("probe"))  # never raised before: no traceback of its own
    me = sys._getframe()
    for read in (fut.wait, fut.value):
        try:
            read()
        except ValueError as exc:
            tb = exc.__traceback__
            exc.__traceback__ = None  # the next read starts from an empty one again
            while tb is not None:
                if tb.tb_frame is not me:
                    codes.add(tb.tb_frame.f_code)
                tb = tb.tb_next
    return frozenset(codes)


_UNWRAP_CODES = _unwrap_codes()


def failure(fut: Any) -> BaseException | None:
    """The exception a completed future failed with, or None if it holds a
    value; the exception's traceback is left as the future was given it
    (this read adds nothing that could keep its caller alive)."""
    try:
        # (the future's own value(): a call future's raises a copy, which
        # this returns; torch's C read would hand out the object the future
        # holds, to be shared with whatever is failed with it next)
        fut.value()
    except BaseException as exc:  # the future's own failure, whatever its type
        _strip(exc, sys._getframe())
        return exc
    return None


def result(fut: Any) -> Any:
    """``fut.wait()``, raising a copy of the future's exception if it failed.

    The copy, not the object the future holds, collects the frames it
    passes on its way up, so the caller's frames die with it; it keeps the
    original's type, arguments, attributes, cause and traceback.  An
    exception that cannot be copied (its class cannot be rebuilt from its
    arguments) is raised itself, stripped of this read's frames.
    """
    try:
        return fut.wait()
    except Exception as exc:
        error = detach(exc, sys._getframe())
    raise error  # outside the except block: no implicit context on the copy


def detach(exc: BaseException, reader: Any) -> BaseException:
    """What to raise in place of ``exc``, which a future holds and just
    raised in the frame ``reader``: a copy, as :func:`result` raises (raise
    it outside the ``except`` block, or the copy's context is ``exc``)."""
    return _copy(_strip(exc, reader))


def fail(fut: Any, exc: BaseException) -> None:
    """``fut.set_exception(exc)`` for an ``exc`` caught by the caller: without
    the caller's own traceback entry (nor those of a future's read that
    raised it), as the caller's frame holds ``fut``."""
    _strip(exc, sys._getframe(1))
    fut.set_exception(exc)


def forward(src: Any, dst: Any, transform: Callable[[Any], Any] | None = None) -> None:
    """Complete ``dst`` as ``src`` completed (a callback of ``src``), with
    ``transform(value)`` where given; ``set_exception`` keeps the error's
    type, where ``then()`` would not."""
    exc = failure(src)
    if exc is not None:
        dst.set_exception(exc)
    else:
        value = src.value()
        dst.set_result(value if transform is None else transform(value))


def _strip(exc: BaseException, reader: Any) -> BaseException:
    """Drop the traceback entries that raising ``exc`` from a future in the
    frame ``reader`` just prepended."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and (tb.tb_frame is reader or tb.tb_frame.f_code in _UNWRAP_CODES):
        tb = tb.tb_next
    exc.__traceback__ = tb
    return exc


def _copy(exc: BaseException) -> BaseException:
    try:
        fresh = copy.copy(exc)
    except Exception:
        return exc
    if type(fresh) is not type(exc):
        return exc
    fresh.__traceback__ = exc.__traceback__
    fresh.__cause__ = exc.__cause__
    fresh.__context__ = exc.__context__
    fresh.__suppress_context__ = exc.__suppress_context__
    return fresh


class _FirstFailure:
    """Watches ``futures`` until all completed or one failed, then sets
    :attr:`ended` and calls ``on_end`` (once)."""

    def __init__(self, futures: list[Any], on_end: Callable[[_FirstFailure], None] | None = None
                 ) -> None:
        self._lock = threading.Lock()
        self._left = len(futures)
        self._on_end = on_end
        self.error: BaseException | None = None
        self.ended = threading.Event()
        if not futures:
            self._end()
        for fut in futures:
            if _is_done(fut):
                # What torch would do at once for a done future, without its
                # callback machinery (a wrapper, a release of the GIL, a call
                # back in): wait_all mostly finds a burst's futures done
                # (issue 52).
                self._done(fut)
            else:
                # torch's own method, not a subclass's: this callback only
                # notes the outcome, so a ucxrpc call's future may run it
                # where it is completed (agent/calls.py hands futures with
                # user callbacks to a pool instead).
                _add_done_callback(fut, self._done)

    def _done(self, fut: Any) -> None:
        exc = failure(fut)  # value(), not wait(): no stream work on this thread
        if exc is not None:
            with self._lock:
                first = self.error is None and self._left > 0
                if first:
                    self.error = exc
            if first:
                self._end()
            return
        with self._lock:
            self._left -= 1
            last = self._left == 0 and self.error is None
        if last:
            self._end()

    def _end(self) -> None:
        self.ended.set()
        if self._on_end is not None:
            self._on_end(self)


def wait_all(futures: list[Any]) -> list[Any]:
    """torch's ``wait_all``: every future's value, in order; raises the first
    failure as soon as one future fails, without waiting for the others."""
    futures = list(futures)
    watch = _FirstFailure(futures)
    watch.ended.wait()
    if watch.error is not None:
        raise _copy(watch.error)
    plain = PLAIN_WAITS
    return [_c_wait(fut) if type(fut) in plain else fut.wait() for fut in futures]


def collect_all(futures: list[Any]) -> Any:
    """torch's ``collect_all``: a future of the list of ``futures`` once all
    completed, failed with the first failure as soon as one fails."""
    futures = list(futures)
    out: Any = _Future()

    def finish(watch: _FirstFailure) -> None:
        if watch.error is not None:
            out.set_exception(watch.error)
        else:
            out.set_result(futures)

    _FirstFailure(futures, finish)
    return out


_originals: dict[str, Any] = {}


def install() -> None:
    """Put :func:`wait_all` and :func:`collect_all` in ``torch.futures``."""
    if _originals:
        return
    _originals["wait_all"] = torch.futures.wait_all
    _originals["collect_all"] = torch.futures.collect_all
    torch.futures.wait_all = wait_all
    torch.futures.collect_all = collect_all
