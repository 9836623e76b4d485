"""WorkerPool's accounting of busy threads, which the progress thread's
polling policy reads (agent.core.spin_while_rules)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from ucxrpc.agent import pool as _pool
from ucxrpc.agent.pool import WorkerPool


def test_computing_from_submit_to_finish_and_not_while_blocked():
    quiet = threading.Event()
    pool = WorkerPool(2, on_quiet=quiet.set)
    go, blocked, release = threading.Event(), threading.Event(), threading.Event()

    def task():
        assert go.wait(10)
        with pool.blocking():  # as agent.wait does around a nested call
            blocked.set()
            assert release.wait(10)

    try:
        assert not pool.computing()
        pool.submit(task)
        # Counted at once: the thread that takes the task needs the GIL too.
        assert pool.computing()
        go.set()
        assert blocked.wait(10)
        assert quiet.wait(10) and not pool.computing()  # waiting, not running code
        quiet.clear()
        release.set()
        assert quiet.wait(10)
        assert not pool.computing()
    finally:
        release.set()
        pool.close()


def test_a_second_request_landing_in_a_drivers_turn_does_not_wait_behind_the_first():
    # A pool thread waiting for work drives the transport (idle_wait); two
    # requests may land in one of its turns.  It runs the first itself; the
    # second must start on another thread, not wait for the first to end.
    # (Found by torch's RPC tests: a call queued behind a 20 s one.)
    release, fast_ran = threading.Event(), threading.Event()
    landed = threading.Event()
    pool: WorkerPool

    def slow():
        assert release.wait(10)

    def idle_wait(has_work):
        if not landed.is_set():
            landed.set()
            pool.submit(slow)
            pool.submit(fast_ran.set)
            return
        while not has_work():
            threading.Event().wait(0.001)

    pool = WorkerPool(4, idle_wait=idle_wait)
    try:
        pool.submit(lambda: None)  # starts the first thread, which then drives
        assert fast_ran.wait(10), "the second request waited behind the first"
    finally:
        release.set()
        pool.close()


def test_a_burst_is_served_by_the_running_thread_not_one_thread_per_request(monkeypatch):
    # With the watchdog out of the way, a burst submitted at once wakes one
    # thread, which takes every task in turn: queued work waits for a
    # running thread rather than waking another (a GIL-bound callee gains
    # nothing from a second thread, only hand-offs).
    monkeypatch.setattr(_pool, "WATCH_WINDOW_S", 60.0)
    monkeypatch.setattr(_pool, "STALL_MAX_S", 60.0)
    pool = WorkerPool(8)
    ran = []
    gate = threading.Event()
    try:
        pool.submit(gate.wait, 10)
        for i in range(100):
            pool.submit(ran.append, threading.get_ident())
        gate.set()
        done = threading.Event()
        pool.submit(done.set)
        assert done.wait(10)
        assert len(set(ran)) == 1 and len(ran) == 100
        assert len(pool._threads) == 1 and pool.stalls == 0
    finally:
        pool.close()


def test_a_request_queued_as_the_thread_ends_its_task_waits_for_that_thread(monkeypatch):
    # Between the end of a task and its next look at the queue, a thread is
    # on its way to it, as a woken one is: a request queued then (by the
    # progress thread, on a callee) is its next task.  Counted off in that
    # window, it woke or started another thread, and a callee's pool grew
    # to six threads in rpc_async bursts (benchmarks/runs/BB.md).
    monkeypatch.setattr(_pool, "WATCH_WINDOW_S", 60.0)
    monkeypatch.setattr(_pool, "STALL_MAX_S", 60.0)
    ran: list[int] = []
    sent = threading.Event()
    pool: WorkerPool

    def in_the_window() -> None:
        # on_quiet runs on the pool thread right after its task ended, before
        # its next look at the queue: another thread submits meanwhile.
        if sent.is_set():
            return
        sent.set()
        other = threading.Thread(target=pool.submit, args=(ran.append, 2))
        other.start()
        other.join(10)

    pool = WorkerPool(8, on_quiet=in_the_window)
    try:
        pool.submit(ran.append, 1)
        assert sent.wait(10)
        deadline = time.monotonic() + 10
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ran == [1, 2]
        assert len(pool._threads) == 1 and pool._waking == 0
    finally:
        pool.close()


def test_queued_work_behind_a_blocked_thread_gets_a_thread_of_its_own():
    # The first task waits for the second, and does not say so (no
    # pool.blocking(): a plain Event, as a user function may).  Only the
    # watchdog can start the thread the second needs; without it this
    # would deadlock, which torch's pool does not.
    pool = WorkerPool(4)
    second = threading.Event()
    first_done = threading.Event()
    try:
        pool.submit(lambda: second.wait(10) and first_done.set())
        pool.submit(second.set)
        assert first_done.wait(10), "the second task waited behind the blocked first"
        assert pool.stalls >= 1 and len(pool._threads) == 2
    finally:
        second.set()
        pool.close()


def test_watchdog_takes_a_busy_process_for_starved_not_stuck():
    # A process that used its core through the window has threads waiting
    # for the GIL or a core: one more thread would wait with them.  One
    # that idled has its running threads blocked.  Past STALL_MAX_S the
    # work gets a thread whatever the process did (a user function may hold
    # the GIL computing, and torch would run the next request beside it).
    w = _pool.WATCH_WINDOW_S
    assert not _pool.stalled(w, 0.9 * w, 2 * w)
    assert _pool.stalled(w, 0.1 * w, 2 * w)
    assert _pool.stalled(w, w, _pool.STALL_MAX_S)


def test_watchdog_gives_a_thread_past_the_bound_while_the_process_computes(monkeypatch):
    monkeypatch.setattr(_pool, "STALL_MAX_S", 0.0)
    pool = WorkerPool(4)
    release, ran = threading.Event(), threading.Event()
    try:
        pool.submit(release.wait, 10)
        pool.submit(ran.set)
        deadline = time.monotonic() + 10
        while not ran.is_set() and time.monotonic() < deadline:
            pass  # computing: the process is busy all along
        assert ran.is_set()
    finally:
        release.set()
        pool.close()


def test_wake_ups_reach_every_thread_a_burst_needs():
    # Tasks that all block until the others run (a barrier of ``size``)
    # pass only if the watchdog starts a thread for each one queued behind
    # the blocked ones; the pool then still serves a second burst from its
    # sleepers.
    size = 4
    pool = WorkerPool(size)
    try:
        for _ in range(2):
            barrier = threading.Barrier(size, timeout=10)
            done = threading.Semaphore(0)

            def task(barrier=barrier, done=done):
                barrier.wait()
                done.release()

            for _ in range(size):
                pool.submit(task)
            for _ in range(size):
                assert done.acquire(timeout=10)
        assert len(pool._threads) == size
    finally:
        pool.close()


def test_close_runs_queued_work_and_stops_sleeping_threads():
    pool = WorkerPool(3)
    ran = []
    gate = threading.Event()
    pool.submit(gate.wait, 10)
    for i in range(5):
        pool.submit(ran.append, i)
    gate.set()
    pool.close()
    assert sorted(ran) == list(range(5))
    assert not any(t.is_alive() for t in pool._threads)


class _Starved(_pool.RunQueueClock):
    """A process whose threads wait for a core all the time: another
    process (or the caller beside it) has the cores."""

    def __init__(self) -> None:
        self.works = True

    def read(self) -> float:
        return time.monotonic()

    def close(self) -> None:
        pass


def test_watchdog_takes_a_process_waiting_for_a_core_for_starved_not_stuck(monkeypatch):
    # The running task uses no CPU, as a thread that is not scheduled does
    # not; by CPU time alone the window idled.  Its threads waited for a
    # core meanwhile, so the work waits for the running thread and no
    # thread is started for it.
    monkeypatch.setattr(_pool, "STALL_MAX_S", 60.0)
    pool = WorkerPool(4, run_queue=_Starved)
    release, ran = threading.Event(), []
    try:
        pool.submit(release.wait, 10)
        pool.submit(lambda: ran.append(threading.get_ident()))
        # Many windows pass (WATCH_WINDOW_S is 2 ms): none confirms a stall.
        time.sleep(50 * _pool.WATCH_WINDOW_S)
        assert not ran and pool.stalls == 0 and len(pool._threads) == 1
        release.set()
        done = threading.Event()
        pool.submit(done.set)
        assert done.wait(10)
        assert ran == [pool._threads[0].ident] and pool.stalls == 0
    finally:
        release.set()
        pool.close()


_COMPETING = r"""
import hashlib, os, threading, time
from ucxrpc.agent.pool import RunQueueClock
clock = RunQueueClock()
if not clock.works:
    print("no schedstat")
    raise SystemExit(0)
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core for both threads
stop = threading.Event()
def hashing():
    data = bytes(8 << 20)
    while not stop.is_set():
        hashlib.sha256(data)  # drops the GIL: both threads want the core
threads = [threading.Thread(target=hashing, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
try:
    before = clock.read()
    time.sleep(0.5)
    after = clock.read()
finally:
    stop.set()
    for t in threads:
        t.join(10)
    clock.close()
print(after - before)
"""


@pytest.mark.processes
def test_run_queue_clock_counts_threads_waiting_for_a_core():
    # Two threads hashing without the GIL on one core: each waits while the
    # other runs, and the kernel accounts that wait as each is scheduled in.
    proc = subprocess.run([sys.executable, "-c", _COMPETING], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.strip() == "no schedstat":
        pytest.skip("this kernel keeps no schedstat (a sandbox): the watchdog uses CPU time")
    assert float(proc.stdout) > 0.0, proc.stdout
