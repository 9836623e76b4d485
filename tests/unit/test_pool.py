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
