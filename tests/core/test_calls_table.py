"""The native table of calls in flight (csrc/calls.c, ``_core.Calls``) as C
code: what goes in comes out once, deadlines in order, answered calls'
entries forgotten, its references, its argument checks, and one taker per
call among threads that race.  What the table means to the agent (futures
completed, torch's timeout error) is tests/agent/test_calls.py's."""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
import weakref

import pytest

from ucxrpc import _core
from ucxrpc.agent.calls import Call


def _table() -> _core.Calls:
    return _core.Calls(Call)


def test_a_call_comes_out_once_as_it_went_in():
    t = _table()
    fut = object()
    assert t.add(7, fut, 3, True, None) is False  # no deadline: nothing to tell
    assert len(t) == 1 and t.by_id == {7: fut}
    call = t.pop(7)
    assert type(call) is Call and call == (fut, 3, True) and call.future is fut
    assert t.pop(7) is None and len(t) == 0 and t.by_id == {}
    assert t.pop(8) is None  # never there


def test_no_reference_is_kept_or_lost_on_the_way_through():
    t = _table()
    fut, peer = object(), 12345678901  # a peer id no small-int cache holds
    before = sys.getrefcount(fut), sys.getrefcount(peer)
    for i in range(1000):
        t.add(i, fut, peer, False, 60.0)
    assert sys.getrefcount(fut) == before[0] + 1000  # the table holds each
    for i in range(1000):
        call = t.pop(i)
        assert call.future is fut
        del call
    t.add(2000, fut, peer, True, None)
    assert t.take_peer(peer) == [2000]
    t.pop(2000)
    t.expire(time.monotonic() + 120)  # the deadlines go with nothing left to hold
    assert (sys.getrefcount(fut), sys.getrefcount(peer)) == before


def test_a_peers_calls_are_taken_by_peer_and_no_other():
    t = _table()
    for i in range(5):
        t.add(i, f"f{i}", i % 2, False, None)
    assert sorted(t.take_peer(1)) == [1, 3]
    assert t.take_peer(1) == [] and t.take_peer(9) == []
    # Taking the ids leaves the calls for the taker to pop (CallTable.fail).
    assert t.pop(1) == ("f1", 1, False)
    assert sorted(t.by_id) == [0, 2, 3, 4]
    assert t.pop(0) == ("f0", 0, False)


def test_deadlines_expire_in_order_and_answered_ones_are_forgotten():
    t = _table()
    assert t.add(1, "a", 0, False, 0.0) is True  # the first in its FIFO: tell the timer
    assert t.add(2, "b", 0, False, 0.0) is False
    assert t.add(3, "c", 0, False, 60.0) is True  # another timeout, another FIFO
    t.pop(2)  # answered
    assert t.armed() == 3
    expired, wait = t.expire(time.monotonic())
    assert expired == [(1, 0.0)]  # the answered one is dropped, not reported
    assert 0.0 < wait <= 0.1  # call 3 is queued: looked at again soon
    assert t.armed() == 1
    assert 1 in t.by_id  # expire reports; the caller takes the call out
    # Each entry is reported once: call 1, not taken out, is not again.
    assert t.expire(time.monotonic() + 61)[0] == [(3, 60.0)]


def test_an_empty_table_lets_the_timer_wait_until_told():
    t = _table()
    assert t.expire(time.monotonic()) == ([], None)
    t.add(1, "a", 0, False, 30.0)
    t.pop(1)
    assert t.expire(time.monotonic()) == ([], None)  # its entry dropped on the way
    assert t.armed() == 0


def test_arm_adds_a_deadline_to_a_call_added_without_one():
    t = _table()
    t.add(1, "a", 0, False, None)
    assert t.armed() == 0
    assert t.arm(1, 0.0) is True
    assert t.expire(time.monotonic())[0] == [(1, 0.0)]


def test_answered_entries_behind_a_slow_call_are_compacted():
    """One slow call at the head holds its FIFO; thousands answered behind
    it would stay till its deadline (at 20k calls/s with the 60 s default,
    over a million entries), so the FIFO is rebuilt without them."""
    t = _table()
    t.add(0, "slow", 0, False, 60.0)
    for i in range(1, 3001):
        t.add(i, "quick", 0, False, 60.0)
        t.pop(i)
    assert t.armed() == 3001
    expired, _ = t.expire(time.monotonic())
    assert expired == [] and t.armed() == 1
    # The FIFO still works after the rebuild.
    t.add(5000, "late", 0, False, 60.0)
    assert t.armed() == 2
    assert t.expire(time.monotonic() + 120)[0] == [(0, 60.0), (5000, 60.0)]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="tuple subclass"):
        _core.Calls(dict)
    t = _table()
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        t.add(1, "a", 0, False, -1.0)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        t.add(1, "a", 0, False, math.nan)
    assert len(t) == 0 and t.take_peer(0) == []  # a refused call is not left in
    t.add(1, "a", 0, False, None)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        t.arm(1, -0.5)
    assert t.armed() == 0 and t.pop(1) == ("a", 0, False)
    with pytest.raises(TypeError):
        t.add("one", "a", 0, False, None)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        t.add(1, "a", 0)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        t.arm(1)


def test_a_table_in_a_reference_cycle_is_collected():
    """The table holds futures, and a future's callback may hold the table
    (an agent's own): the collector must see through it."""

    class Future:
        pass

    t = _table()
    fut = Future()
    fut.table = t  # type: ignore[attr-defined]
    t.add(1, fut, 0, False, 5.0)
    gone = weakref.ref(fut)
    del t, fut
    gc.collect()
    assert gone() is None


def test_racing_takers_get_each_call_once_while_collections_run():
    """CallTable.pop from a reply, the timer and a failed peer at once: each
    call is taken by exactly one of them, none is lost.  The table has no
    lock of its own: it relies on the GIL, which a collection can let go of
    (a gc callback or a finalizer runs Python code), so collections are
    made frequent here, and each sleeps, letting the other takers in
    wherever one starts."""

    def let_others_in(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(0.0002)

    t = _table()
    n = 400
    for i in range(n):
        t.add(i, i, i % 3, False, 0.0 if i % 2 else None)
    # The Calls are kept: a Call freed at once would give back its count
    # towards the next collection.
    taken: list[list[Call]] = [[] for _ in range(4)]
    start = threading.Barrier(4)
    # The two poppers try each call at the same moment: alone, one ran
    # ahead and the other found every call gone.
    lockstep = threading.Barrier(2)

    def take(k: int, i: int) -> None:
        call = t.pop(i)
        if call is not None:
            taken[k].append(call)

    def popper(k: int) -> None:
        start.wait()
        for i in range(n):
            lockstep.wait()
            take(k, i)

    def peer_failer(k: int) -> None:
        start.wait()
        for peer in (0, 1, 2):
            for i in t.take_peer(peer):
                take(k, i)

    def expirer(k: int) -> None:
        start.wait()
        deadline = time.monotonic() + 30
        while len(t) and time.monotonic() < deadline:
            for i, _timeout in t.expire(time.monotonic())[0]:
                take(k, i)
            time.sleep(0)

    old = gc.get_threshold()
    gc.set_threshold(1, 1000, 1000)
    gc.callbacks.append(let_others_in)
    try:
        threads = [threading.Thread(target=f, args=(k,)) for k, f in
                   enumerate((popper, popper, peer_failer, expirer))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
            assert not th.is_alive(), "a taker did not finish"
    finally:
        gc.callbacks.remove(let_others_in)
        gc.set_threshold(*old)
    every = sorted(call.future for part in taken for call in part)
    assert every == list(range(n))  # each once: none lost, none twice
    assert len(t) == 0
