"""WorkerPool's accounting of busy threads, which the progress thread's
polling policy reads (agent._spin_while)."""

from __future__ import annotations

import threading

from ucxrpc._pool import WorkerPool


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


def test_wake_ups_passed_on_reach_every_thread_a_burst_needs():
    # One submit wakes one thread; a thread that takes a task and leaves
    # more wakes the next.  Tasks that all block until the others run (a
    # barrier of ``size``) pass only if that hand-on reaches ``size``
    # threads; the pool then still serves a second burst from its sleepers.
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
