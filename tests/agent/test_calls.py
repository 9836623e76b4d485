"""The agent's table of calls waiting for replies (agent/calls.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ucxrpc.agent import calls
from ucxrpc.agent.calls import CallFuture, CallTable, SyncReply
from ucxrpc.errors import BrokenError, ClosedError, RpcTimeoutError


@pytest.fixture
def table():
    t = CallTable("test")
    t.start()
    yield t
    t.close(ClosedError("test over"))


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_call_past_its_deadline_fails_with_torchs_timeout_error(table: CallTable) -> None:
    fut = torch.futures.Future()
    table.add(1, fut, peer=3)
    table.arm(1, 0.05)
    _wait(fut.done, "the deadline")
    with pytest.raises(RpcTimeoutError, match=r"RPC ran for more than set timeout \(50 ms\)"):
        fut.wait()
    assert table.timeouts == 1 and len(table) == 0


def test_an_answered_calls_deadline_is_dropped(table: CallTable) -> None:
    fut = torch.futures.Future()
    table.add(1, fut, peer=3)
    table.arm(1, 60.0)
    assert table.pop(1) is not None and table.pop(1) is None  # answered once
    _wait(lambda: table.armed() == 0, "the answered entry to go")
    assert not fut.done() and table.timeouts == 0


def test_a_peers_failure_fails_its_calls_only(table: CallTable) -> None:
    futs = {i: torch.futures.Future() for i in range(4)}
    for i, f in futs.items():
        table.add(i, f, peer=i % 2)
    table.fail_peer(1, BrokenError("worker1 died"))
    assert [f.done() for f in futs.values()] == [False, True, False, True]
    with pytest.raises(BrokenError, match="worker1 died"):
        futs[1].wait()
    assert len(table) == 2


def test_close_fails_what_is_left() -> None:
    t = CallTable("closing")
    t.start()
    fut = torch.futures.Future()
    t.add(7, fut, peer=0)
    t.close(ClosedError("agent shut down"))
    with pytest.raises(ClosedError, match="agent shut down"):
        fut.wait()


def test_an_rpc_sync_reply_slot_gives_its_value_or_raises_its_error(table: CallTable) -> None:
    ok, bad = SyncReply(), SyncReply()
    table.add(1, ok, peer=3, waited=True)
    table.add(2, bad, peer=3, waited=True)
    assert not ok.done()
    call = table.pop(1)
    assert call is not None
    table.complete(call, value={"x": 1})
    assert ok.done() and ok.wait() == {"x": 1}
    err = BrokenError("worker w3 is unreachable")
    table.fail(2, err)
    with pytest.raises(BrokenError) as info:
        bad.wait()
    assert info.value is err and len(table) == 0


def test_an_rpc_sync_reply_slot_blocks_its_waiter_until_it_is_set() -> None:
    slot = SyncReply()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(slot.wait()))
    waiter.start()
    _wait(lambda: slot.waiting == 1, "the waiter to block")
    assert waiter.is_alive() and not got
    slot.set_result(42)
    waiter.join(10)
    assert not waiter.is_alive() and got == [42]


def test_an_rpc_sync_reply_slot_fails_at_its_deadline(table: CallTable) -> None:
    slot = SyncReply()
    table.add(1, slot, peer=3, waited=True)
    table.arm(1, 0.05)
    with pytest.raises(RpcTimeoutError, match="RPC ran for more than set timeout"):
        slot.wait()  # woken by the timer thread


def _thread_of(ran_on: list[str]):
    return lambda _fut: ran_on.append(threading.current_thread().name)


def test_a_future_completes_where_the_reply_lands_unless_a_callback_is_hooked_on(
        table: CallTable) -> None:
    plain, hooked = CallFuture(), CallFuture()
    ran_on: list[str] = []
    hooked.then(_thread_of(ran_on))
    for msg_id, fut in ((1, plain), (2, hooked)):
        table.add(msg_id, fut, peer=7)
        call = table.pop(msg_id)
        assert call is not None
        table.complete(call, value=msg_id)
    assert plain.done() and plain.value() == 1  # inline, on this thread
    _wait(lambda: ran_on, "the hooked future's callback")
    assert ran_on != [threading.current_thread().name] and hooked.value() == 2
    assert not calls._settling


def test_a_callback_hooked_on_while_the_future_completes_inline_runs_on_its_own_thread(
        table: CallTable) -> None:
    fut = CallFuture()
    table.add(1, fut, peer=7)
    ran_on: list[str] = []
    hooker = threading.Thread(target=lambda: fut.then(_thread_of(ran_on)), name="hooker",
                              daemon=True)

    def midway(_: torch.futures.Future) -> None:
        # Inside the inline completion (a callback chained in C++, as
        # wait_all's): the hooker comes now, and must wait for its end.
        hooker.start()
        _wait(lambda: calls._settling.get(id(fut), (0, None))[1] is not None,
              "the hooker to wait")
        assert not ran_on

    torch._C.Future.add_done_callback(fut, midway)  # torch's: not a hook
    call = table.pop(1)
    assert call is not None
    table.complete(call, value=3)
    hooker.join(10)
    assert ran_on == ["hooker"] and not calls._settling
    assert fut.value() == 3


def test_a_callback_hooked_on_by_the_completion_itself_runs_at_once(table: CallTable) -> None:
    # A callback chained in C++ (wait_all's, collect_all's) runs inside the
    # completion; code it runs may hook a callback onto the same future.
    fut = CallFuture()
    table.add(1, fut, peer=7)
    ran: list[int] = []
    torch._C.Future.add_done_callback(
        fut, lambda f: f.then(lambda g: ran.append(g.value())))  # as a chained one would
    call = table.pop(1)
    assert call is not None
    completer = threading.Thread(target=table.complete, args=(call, 4), daemon=True)
    completer.start()
    completer.join(10)
    assert not completer.is_alive(), "the completion waited for itself"
    assert ran == [4] and not calls._settling


def test_an_outstanding_call_costs_the_garbage_collector_its_future_only(
        table: CallTable) -> None:
    # Objects that outlive young collections set off full ones (a tenth of a
    # second each once torch is imported): the table adds none per call.
    import gc
    futures = [CallFuture() for _ in range(500)]
    gc.collect()
    before = len(gc.get_objects())
    for i, fut in enumerate(futures):
        table.add(i, fut, peer=i % 3, waited=i % 2 == 1)
        table.arm(i, 60.0)
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    call = table.pop(7)
    assert call is not None and call.future is futures[7] and call.peer == 1 and call.waited
    call = table.pop(8)
    assert call is not None and call.peer == 2 and not call.waited
    assert table.pop(8) is None
    table.fail_peer(1, BrokenError("peer 1 died"))
    assert all(futures[i].done() for i in range(1, 500, 3) if i != 7)  # 7 was taken out
    assert not any(futures[i].done() for i in range(0, 500, 3))
