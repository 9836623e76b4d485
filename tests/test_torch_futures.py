"""ucxrpc/_torch_futures.py: reading a failed future leaks nothing.

A failed torch future raises the very exception object it holds, from C++
where the garbage collector cannot see it; each raise adds the frames it
passes to that object's traceback.  These tests hold the future in the
frames that read it, as ucxrpc's RRefs, watchers and callbacks do, and
check that those frames die once dropped, that a traceback does not grow
with every read, and that what the caller gets is the error as it was.
"""

from __future__ import annotations

import gc
import threading
import traceback
import weakref

import pytest
import torch

from ucxrpc import _torch_futures as futures
from ucxrpc.agent.calls import CallFuture


class _Holder:
    """Holds a failed future, as an RRef holds its creation's."""

    def __init__(self, fut: torch.futures.Future) -> None:
        self.fut = fut

    def read(self) -> object:
        return futures.result(self.fut)


def _failed(exc: BaseException, cls: type = torch.futures.Future) -> torch.futures.Future:
    fut = cls()
    fut.set_exception(exc)
    return fut


def _raise_here() -> None:
    raise ValueError("original")


def _raised() -> ValueError:
    try:
        _raise_here()
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


def _depth(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def test_a_plain_wait_keeps_the_reader_alive():
    """What the helpers are for: torch's own wait() leaks the frame."""
    fut = _failed(ValueError("x"))

    class Reader:
        def __init__(self) -> None:
            self.fut = fut

        def read(self) -> None:
            self.fut.wait()

    reader = Reader()
    ref = weakref.ref(reader)
    with pytest.raises(ValueError):
        reader.read()
    del reader
    gc.collect()
    assert ref() is not None


def test_result_lets_a_holder_of_the_future_die():
    holder = _Holder(_failed(_raised()))
    ref = weakref.ref(holder)
    for _ in range(3):
        with pytest.raises(ValueError, match="original"):
            holder.read()
    del holder
    gc.collect()
    assert ref() is None


def test_result_raises_the_error_as_it_was_every_time():
    cause = KeyError("why")
    original = _raised()
    original.__cause__ = cause
    original.remote_traceback = "remote text"  # type: ignore[attr-defined]
    fut = _failed(original)
    depths = []
    for _ in range(3):
        with pytest.raises(ValueError) as info:
            futures.result(fut)
        exc = info.value
        assert exc is not original and type(exc) is ValueError and exc.args == ("original",)
        assert exc.__cause__ is cause and exc.remote_traceback == "remote text"
        # The original raise's frames are kept, those of the reads are not.
        names = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        assert names[-1] == "_raise_here" and "result" in names
        depths.append(_depth(exc))
    assert depths[0] == depths[1] == depths[2]
    assert _depth(original) == 2  # _raised and _raise_here, as it was set


def test_an_exception_that_cannot_be_copied_is_raised_itself():
    class Picky(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    original = Picky(1, 2)
    with pytest.raises(Picky) as info:
        futures.result(_failed(original))
    assert info.value is original


def test_failure_reads_the_error_without_raising_it():
    original = _raised()
    fut = _failed(original)
    assert futures.failure(fut) is original
    assert _depth(original) == 2
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(5)
    assert futures.failure(done) is None


def test_fail_leaves_out_the_callers_frame():
    """An exception caught where the future is held is set without that frame."""
    fut: torch.futures.Future = torch.futures.Future()

    def complete(out: torch.futures.Future) -> None:
        try:
            _raise_here()
        except ValueError as exc:
            futures.fail(out, exc)

    complete(fut)
    exc = futures.failure(fut)
    assert exc is not None
    assert [f.name for f in traceback.extract_tb(exc.__traceback__)] == ["_raise_here"]


def test_forward_completes_as_the_source_did():
    src: torch.futures.Future = torch.futures.Future()
    dst: torch.futures.Future = torch.futures.Future()
    src.set_result([1, 2])
    futures.forward(src, dst)
    assert dst.wait() == [1, 2]
    original = _raised()
    dst2: torch.futures.Future = torch.futures.Future()
    futures.forward(_failed(original), dst2)
    assert futures.failure(dst2) is original


def test_a_call_futures_wait_and_value_raise_copies():
    fut = _failed(_raised(), CallFuture)

    class Waiter:
        def __init__(self) -> None:
            self.fut = fut

        def wait(self) -> None:
            self.fut.wait()

        def value(self) -> None:
            self.fut.value()

    waiter = Waiter()
    ref = weakref.ref(waiter)
    with pytest.raises(ValueError, match="original"):
        waiter.wait()
    with pytest.raises(ValueError, match="original"):
        waiter.value()
    del waiter
    gc.collect()
    assert ref() is None
    ok = CallFuture()
    ok.set_result(3)
    assert ok.wait() == 3 and ok.value() == 3


@pytest.mark.parametrize("cls", [torch.futures.Future, CallFuture])
def test_wait_all_over_futures_done_already_fails_fast_and_keeps_order(cls):
    # wait_all mostly finds a burst's futures done: it reads those at once,
    # and watches only the rest (the same outcome as torch's callbacks).
    done = [cls() for _ in range(3)]
    for i, fut in enumerate(done):
        fut.set_result(i)
    pending = cls()
    later = threading.Timer(0.05, pending.set_result, args=(3,))
    later.start()
    assert futures.wait_all(done + [pending]) == [0, 1, 2, 3]
    later.join()
    never = cls()  # never completed: a failure done already must not wait for it
    with pytest.raises(ValueError, match="a done failure"):
        futures.wait_all([done[0], never, _failed(ValueError("a done failure"), cls)])
    got = futures.collect_all(done).wait()
    assert [f.value() for f in got] == [0, 1, 2]
    failed = futures.collect_all([never, _failed(ValueError("collected"), cls)])
    assert failed.done()
    with pytest.raises(ValueError, match="collected"):
        failed.wait()
