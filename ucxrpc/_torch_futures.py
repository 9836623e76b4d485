"""``torch.futures.wait_all`` and ``collect_all`` that fail as soon as one future fails.

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
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["collect_all", "install", "wait_all"]

_Future = torch.futures.Future
_add_done_callback = torch._C.Future.add_done_callback


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
            # torch's own method, not a subclass's: this callback only notes
            # the outcome, so a ucxrpc call's future may run it where it is
            # completed (agent/calls.py hands futures with user callbacks to
            # a pool instead).
            _add_done_callback(fut, self._done)

    def _done(self, fut: Any) -> None:
        try:
            fut.value()  # value(), not wait(): no stream work on this thread
        except BaseException as exc:  # the future's own failure, whatever its type
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
        raise watch.error
    return [fut.wait() for fut in futures]


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
