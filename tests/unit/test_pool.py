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
