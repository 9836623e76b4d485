"""The shared-memory receive queue check (ucxrpc/transport/watch/canary.py), on a
real UCX worker in a child process.

* A worker whose loop progresses receives the canary: the check passes
  and can run again.
* A worker that does not take the canary in :data:`canary.WAIT_S` of
  listening is declared stuck once, with a reason that says what to do;
  further checks do not run.
* Time the loop was not listening (a stall) does not count.
"""

from __future__ import annotations

import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

TAG = 0x7 << 60  # any tag the test's worker receives nothing else on


def _check(rank, world_size, init_method, scenario):
    import time

    from ucxrpc.transport.watch import canary
    from ucxrpc.transport.ucx.binding import Worker

    canary.WAIT_S = 0.3
    worker = Worker(None)
    reasons: list[str] = []
    check = canary.QueueCheck(worker, None, TAG, reasons.append)
    out = {}

    def poll_until(cond, progress_main: bool, limit_s: float = 20.0) -> None:
        end = time.monotonic() + limit_s
        while not cond() and time.monotonic() < end:
            if progress_main:  # what the progress loop does every turn
                worker.progress()
            check.poll()

    if scenario == "moves":
        for _ in range(2):
            check.start("worker9")
            out.setdefault("states", []).append(check.state.value)
            poll_until(lambda: check.state is not canary.CheckState.WAITING, True)
            out["states"].append(check.state.value)
    elif scenario == "stuck":
        check.start("worker9")
        # The main worker never progresses: the canary never lands.
        poll_until(lambda: check.state is not canary.CheckState.WAITING, False)
        out["state"] = check.state.value
        check.start("worker8")  # final: no further check
        out["after"] = check.state.value
    else:  # "stalled": a stall of the loop moves the clock on
        check.start("worker9")
        time.sleep(canary.WAIT_S * 2)
        check.excuse(canary.WAIT_S * 2, time.monotonic())
        check.poll()
        out["after_stall"] = check.state.value
        poll_until(lambda: check.state is not canary.CheckState.WAITING, True)
        out["state"] = check.state.value
    out["checks"] = check.checks
    out["reasons"] = reasons
    out["stuck"] = check.stuck
    check.close()
    worker.close()
    return out


def test_a_moving_queue_passes_and_can_be_checked_again():
    res = run_workers(_check, 1, args=("moves",), timeout=45)[0]
    assert res["states"] == ["waiting", "idle", "waiting", "idle"]
    assert res["checks"] == 2 and res["reasons"] == [] and res["stuck"] is None


def test_a_canary_that_never_lands_means_stuck_once_with_a_reason():
    res = run_workers(_check, 1, args=("stuck",), timeout=45)[0]
    assert res["state"] == "stuck" and res["after"] == "stuck"
    assert res["checks"] == 1 and len(res["reasons"]) == 1
    reason = res["reasons"][0]
    assert reason == res["stuck"]
    assert "stuck since worker9 failed" in reason and "transports=['tcp']" in reason


def test_time_the_loop_was_not_listening_does_not_count():
    res = run_workers(_check, 1, args=("stalled",), timeout=45)[0]
    assert res["after_stall"] == "waiting"
    assert res["state"] == "idle" and res["reasons"] == []
