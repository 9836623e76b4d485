"""The GIL rule of the direct libucp calls (csrc/ucp.c): a small send or
receive keeps the GIL only while no other thread is inside a UCX call.

* ``ucx_call`` counts the call it makes as inside UCX while it runs, and
  gives the count back when it returns or raises; nothing is inside at rest.
* A small send made while no other thread is inside UCX keeps the GIL: a
  thread that asked for the GIL as a run of sends began gets it only once
  they are over (CPython's switch interval set far out, so that only a
  release could hand it over).  Releasing it around every send starved a
  progress thread waiting for it (benchmarks/runs/BC.md).
* The callback UCX runs when an endpoint fails (ucxx's close callback, into
  Python) sees its thread counted as inside, whether it comes from UCX's
  progress as the transport's loop runs it (``Worker.progress``) or from a
  send on that endpoint: a thread sending at that moment releases the GIL,
  so the callback can take it while its thread holds the worker's lock.
  The peer is a process of the test's own, killed once the endpoints are
  wired up; a second thread sends small frames on the failing endpoint
  throughout, and ends failed or stopped, not hung on the worker's lock.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

TAG = 0x5 << 60

_PEER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from ucxrpc.transport.ucx.binding import Endpoint, Worker
    here = sys.argv[1]
    worker = Worker(("tcp",))
    with open(here + "/b.tmp", "wb") as f:
        f.write(worker.address)
    os.rename(here + "/b.tmp", here + "/b")
    while not os.path.exists(here + "/a"):
        time.sleep(0.01)
    ep = Endpoint(worker, open(here + "/a", "rb").read(), lambda exc: None)
    sent = ep.tag_send(np.arange(16, dtype=np.uint8), int(sys.argv[2]))
    end = time.monotonic() + 20
    while not os.path.exists(here + "/die") and time.monotonic() < end:
        worker.progress()
    os._exit(0)
""")


def _scenario(rank, world_size, init_method, here):
    import os
    import threading
    import time

    import numpy as np

    from ucxrpc.errors import RpcError
    from ucxrpc.transport.ucx.binding import Endpoint, Worker
    from ucxrpc.transport.ucx.ucp import ucx_call, ucx_inside

    out: dict = {"at_rest": ucx_inside()}
    out["counted"] = ucx_call(lambda a, b: (a + b, ucx_inside()), 1, 2)
    try:
        ucx_call(lambda: 1 / 0)
    except ZeroDivisionError:
        out["after_raise"] = ucx_inside()

    worker = Worker(("tcp",))
    with open(here + "/a.tmp", "wb") as f:
        f.write(worker.address)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, here, str(TAG)])
    try:
        os.rename(here + "/a.tmp", here + "/a")
        end = time.monotonic() + 30
        while not os.path.exists(here + "/b"):
            if time.monotonic() > end or peer.poll() is not None:
                raise TimeoutError("the peer never published its address")
            time.sleep(0.01)
        seen: list[int] = []
        ep = Endpoint(worker, open(here + "/b", "rb").read(),
                      lambda exc: seen.append(ucx_inside()))
        while worker.probe(TAG, (1 << 64) - 1) is None:  # wired up: the peer's frame came
            if time.monotonic() > end:
                raise TimeoutError("the peer's frame never came")
            worker.progress()
        stop = threading.Event()
        sends = {"made": 0, "failed": None}

        def sender():
            # A thread sending small frames all along, as a user thread
            # issuing calls does: each send keeps the GIL unless another
            # thread is inside UCX.
            try:
                while not stop.is_set():
                    ep.tag_send(np.zeros(64, dtype=np.uint8), TAG | 1)
                    sends["made"] += 1
                    time.sleep(0.0005)
            except RpcError as exc:
                sends["failed"] = type(exc).__name__

        t = threading.Thread(target=sender, daemon=True)
        t.start()
        open(here + "/die", "w").close()
        peer.wait(20)
        while not seen and time.monotonic() < end:
            worker.progress()
        stop.set()
        t.join(10)
        out.update(seen=seen, sender_alive=t.is_alive(), sends=sends["made"],
                   send_failed=sends["failed"], inside_after=ucx_inside())
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
    return out


def _sends_keep_the_gil(rank, world_size, init_method):
    import sys
    import threading

    import numpy as np

    from ucxrpc.transport.ucx.binding import Endpoint, Worker
    from ucxrpc.transport.ucx.ucp import ucx_inside

    worker = Worker(None)
    ep = Endpoint(worker, worker.address, lambda exc: None)  # to itself
    frame = np.zeros(64, dtype=np.uint8)
    for _ in range(10):  # wired up
        ep.tag_send(frame, TAG | 2)
        worker.progress()
    n = 2000
    done = [0]
    seen: list[int] = []
    go = threading.Event()

    def waiter():
        go.wait()  # blocked without the GIL until the run begins ...
        seen.append(done[0])  # ... then asks for it: how far the run got

    t = threading.Thread(target=waiter)
    t.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switch: only a release hands it over
    try:
        inside = ucx_inside()
        go.set()
        for i in range(n):
            ep.tag_send(frame, TAG | 2)
            done[0] = i + 1
    finally:
        sys.setswitchinterval(old)
    t.join(10)
    return {"inside": inside, "seen": seen, "n": n}


def test_a_small_send_keeps_the_gil_while_no_other_thread_is_inside_ucx():
    res = run_workers(_sends_keep_the_gil, 1, timeout=45)[0]
    assert res["inside"] == 0, res
    # The waiting thread ran only after the last send: none let the GIL go.
    assert res["seen"] == [res["n"]], res


def test_a_callback_from_inside_ucx_sees_its_thread_counted_and_no_sender_hangs(tmp_path):
    res = run_workers(_scenario, 1, args=(str(tmp_path),), timeout=75)[0]
    assert res["at_rest"] == 0 and res["after_raise"] == 0, res
    assert res["counted"] == (3, 1), res
    # The peer's death reached the endpoint's callback, inside a UCX call
    # (progress, or a send on the failing endpoint), counted.
    assert res["seen"] and all(n >= 1 for n in res["seen"]), res
    assert res["inside_after"] == 0, res
    # The sending thread did not hang on the worker's lock.
    assert res["sender_alive"] is False and res["sends"] > 0, res
