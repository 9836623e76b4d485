"""The agent's table of calls waiting for replies (agent/calls.py)."""

from __future__ import annotations

import time

import pytest
import torch

from ucxrpc.agent.calls import CallTable
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
