"""The native core's ``Reply`` (csrc/reply.c; agent/calls.py's
``SyncReply``) as C code: reference counts on every path, waiters woken
however many and whenever they came, Ctrl-C ending a blocked wait, a
drive reading its flag.  What it means for an ``rpc_sync`` is
tests/agent/test_calls.py's to hold."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest

from ucxrpc import _core
from ucxrpc.transport.loop.progress import _MOVES, Owner
from ucxrpc.transport.loop.strategy import POLLS, Polling, Why


def _wait_for(cond, what: str) -> None:
    end = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_every_path_keeps_reference_counts_balanced():
    value, err, kept = object(), LookupError("the call failed"), ["held"]
    watched = [value, err, kept]
    for _ in range(3):  # warm
        r = _core.Reply()
        r.kept = kept
        r.set_result(value)
        assert r() and r.done() and r.wait() is value
    del r
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(1000):
        r = _core.Reply()
        r.kept = kept
        assert not r() and not r.done()
        r.set_result(value)
        assert r.wait() is value and r.wait() is value
        del r
        r = _core.Reply()
        r.set_exception(err)
        with pytest.raises(LookupError) as info:
            r.wait()
        assert info.value is err
        del r, info
        with pytest.raises(TypeError, match="needs an exception"):
            _core.Reply().set_exception(value)
    err.__traceback__ = None
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before


def test_a_reply_in_a_cycle_is_collected():
    r = _core.Reply()
    r.set_result([r])
    ref = sys.getrefcount(r)
    assert ref >= 3
    del r
    assert gc.collect() >= 1


def test_every_waiter_is_woken_when_it_is_set():
    r = _core.Reply()
    got: list[object] = []
    waiters = [threading.Thread(target=lambda: got.append(r.wait())) for _ in range(3)]
    for w in waiters:
        w.start()
    _wait_for(lambda: r.waiting == 3, "three waiters to block")
    r.set_result(7)
    for w in waiters:
        w.join(10)
    assert got == [7, 7, 7] and r.waiting == 0
    assert r.wait() == 7  # after: at once


def test_ctrl_c_ends_a_blocked_wait_and_a_later_set_still_wakes_the_next():
    r = _core.Reply()
    main = threading.get_ident()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        def interrupt() -> None:
            _wait_for(lambda: r.waiting == 1, "the main thread to block")
            signal.pthread_kill(main, signal.SIGINT)
        t = threading.Thread(target=interrupt)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            r.wait()
        t.join(10)
        assert r.waiting == 0 and not r.done()
        later = threading.Thread(target=lambda: (time.sleep(0.05), r.set_result("late")))
        later.start()
        assert r.wait() == "late"
        later.join(10)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_drive_ends_as_its_reply_is_set():
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    reply = _core.Reply()
    turns = []

    def turn() -> bool:
        turns.append(1)
        if len(turns) == 3:
            reply.set_result("answer")
        return True

    loop = _core.Loop(
        (Owner.THREAD, Owner.DRIVER, Owner.LINGER, Owner.STOPPED), _MOVES, Why.AWAITED, POLLS,
        progress=lambda: None, turn=turn, expected=lambda overdue: Why.IN_FLIGHT,
        pending=lambda: False, quiet=lambda: False, spin=None, on_taken=None,
        sleep=lambda now, timeout: False, on_error=lambda exc: None, strategy=Polling(),
        wake_fd=fd, park_fd=fd, linger_fd=fd, spin_s=1.0, spin_chunk_s=1e-4, linger_s=0.002,
        sleep_s=0.1)
    try:
        assert loop.drive(reply)  # (its flag read: csrc/loop.c's is_done)
        assert len(turns) == 3 and reply.wait() == "answer"
    finally:
        os.close(fd)
