"""A caller waiting in ``rpc_sync``, and an idle pool thread waiting for the
next request, progress the transport themselves (Transport.drive), so a
message is handled on the thread that wants it.

* Both sides really drive (counted in the debug info), and calls from
  several threads at once, nested calls and async calls still all complete.
* Ctrl-C in a main thread that drives interrupts its own ``rpc_sync`` only
  between two turns: no other thread's reply is lost or handled twice, and
  the agent keeps serving.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.faults import _common as c
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def square(x: int) -> int:
    return x * x


def nested(x: int) -> int:
    import ucxrpc as rpc

    # A pool thread waiting for its own call: it drives while it waits.
    return rpc.rpc_sync("worker0", square, args=(x,)) + 1


def _drives(rank, world_size, init_method):
    import ucxrpc as rpc

    # Polling: the adaptive strategy may stop polling on a busy CI host,
    # and then nobody drives (correctly); here every wait may.
    c.init(rank, world_size, init_method, progress="polling")
    out = {}
    if rank == 0:
        out["sync"] = [rpc.rpc_sync("worker1", square, args=(i,)) for i in range(100)]
        out["nested"] = [rpc.rpc_sync("worker1", nested, args=(i,)) for i in range(20)]
        results: dict[int, list[int]] = {}

        def caller(k: int) -> None:
            results[k] = [rpc.rpc_sync("worker1", square, args=(k * 100 + i,))
                          for i in range(50)]

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        futs = [rpc.rpc_async("worker1", square, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out["threads"] = results
        out["async"] = [f.wait() for f in futs]
        out["mine"] = rpc._get_debug_info()["progress"]
        out["theirs"] = rpc.rpc_sync("worker1", rpc._get_debug_info)["progress"]
    rpc.shutdown()
    return out


def test_callers_and_idle_pool_threads_drive_and_everything_completes():
    res = run_workers(_drives, 2, timeout=90)[0]
    assert res["sync"] == [i * i for i in range(100)]
    assert res["nested"] == [i * i + 1 for i in range(20)]
    assert res["threads"] == {k: [(k * 100 + i) ** 2 for i in range(50)] for k in range(4)}
    assert res["async"] == [i * i for i in range(200)]
    # The caller drove for its replies; the callee's pool threads for the
    # next request (and the nested calls' replies).  Whether a pool
    # thread's drive also got the baton is the scheduler's: in a full
    # suite on two cores the callee's progress thread once held it for
    # every one of 342 drives (the requests all handled, by it).
    assert res["mine"]["drives"] > 0 and res["mine"]["driven_turns"] > 0, res["mine"]
    assert res["theirs"]["drives"] > 0, res["theirs"]


def _interrupted(rank, world_size, init_method):
    import ucxrpc as rpc

    # Python's own Ctrl-C handler, whatever the runner left: a shell starts a
    # background job with SIGINT ignored, and then no KeyboardInterrupt comes.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    c.init(rank, world_size, init_method, progress="polling")
    out = {}
    if rank == 0:
        stop = threading.Event()
        got: list[int] = []

        errors: list[str] = []

        def other_thread() -> None:  # replies the main thread's turns handle
            i = 0
            try:
                while not stop.is_set():
                    # A reply lost in a turn cut short would time out here.
                    got.append(rpc.rpc_async("worker1", square, args=(i,), timeout=10).wait())
                    i += 1
            except Exception as exc:
                errors.append(f"call {i}: {type(exc).__name__}: {exc}")

        def ctrl_c() -> None:
            for _ in range(20):
                time.sleep(0.02)
                os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=other_thread)
        sender = threading.Thread(target=ctrl_c)
        t.start()
        sender.start()
        interrupted = calls = 0
        while True:
            try:
                if not sender.is_alive():
                    break
                rpc.rpc_sync("worker1", square, args=(3,))
                calls += 1
            except KeyboardInterrupt:
                interrupted += 1
        sender.join()
        stop.set()
        t.join(60)
        out["interrupted"] = interrupted
        out["calls"] = calls
        out["got"] = got
        out["errors"] = errors
        out["after"] = rpc.rpc_sync("worker1", square, args=(7,))
    rpc.shutdown()
    return out


def test_ctrl_c_in_a_driving_main_thread_loses_nothing():
    res = run_workers(_interrupted, 2, timeout=90)[0]
    # Ctrl-C reached the main thread as KeyboardInterrupt (two that come
    # while one is held, or while it waits in C++, count once, as in Python).
    assert 0 < res["interrupted"] <= 20 and res["calls"] > 0, res
    # The other thread's calls, whose replies the main thread's turns
    # handled, all came back once and right, in order.
    assert res["errors"] == []
    assert res["got"] == [i * i for i in range(len(res["got"]))] and res["got"]
    assert res["after"] == 49
