"""Silence that is not death: a peer busy with a large transfer, and a
stall of our own.

Failure detection declares a peer dead after ``peer_timeout`` seconds of
silence.  A peer that is sending or receiving hundreds of megabytes is not
silent: its bytes are arriving.  And a worker whose own progress thread was
held up (an overloaded machine, the GIL, a slow callback) heard nothing
because it was not listening.  These are the false positives the fault tests
must not trip over, checked on their own with a timeout short enough that
the transfer or the stall always outlasts it.
"""

from __future__ import annotations

import time

import pytest

from tests.faults import _common as c
from tests.workers import run_workers

pytestmark = pytest.mark.timeout(60)

NBYTES = 256 << 20
SHORT_PEER_TIMEOUT = 0.5


def _pair(rank, world_size, init_method):
    import torch

    import ucxrpc as rpc

    c.init(rank, world_size, init_method, peer_timeout=SHORT_PEER_TIMEOUT)
    out = {}
    if rank == 0:
        big = torch.full((NBYTES // 4,), 5.0)
        out["echo_s"] = []
        for _ in range(3):
            t0 = time.monotonic()
            back = rpc.rpc_sync("worker1", c.echo, args=(big,))
            out["echo_s"].append(round(time.monotonic() - t0, 3))
            assert torch.equal(back, big)
            del back
        out["pipes"] = rpc.get_pipe_info()
    out["shutdown_s"] = c.timed_shutdown()
    return out


def test_large_transfer_outlasting_peer_timeout_is_not_a_dead_peer():
    res = run_workers(_pair, 2, timeout=50)
    print(f"\n  256 MiB echoes with peer_timeout={SHORT_PEER_TIMEOUT} s: {res[0]['echo_s']} s "
          f"over {[p['transports'] for p in res[0]['pipes']]}")


def _stalled(rank, world_size, init_method):
    import ucxrpc as rpc
    from ucxrpc import api

    c.init(rank, world_size, init_method, peer_timeout=SHORT_PEER_TIMEOUT)
    out = {}
    if rank == 0:
        # The first call says HELLO; then our progress thread is held for 6x
        # the handshake's allowance, before it can read worker1's answer.
        fut = rpc.rpc_async("worker1", c.add, args=(2, 3))
        api._agent.transport._call_soon(lambda: time.sleep(6 * SHORT_PEER_TIMEOUT))
        out["first"] = fut.wait()
        out["pipes"] = [p["state"] for p in rpc.get_pipe_info()]
        out["second"] = rpc.rpc_sync("worker1", c.add, args=(3, 4))
        # (A stall on a pipe the peer uses too is another matter: to the peer
        # we are a stopped process, as test_stopped_peer.py has it.)
        rpc.rpc_sync("worker1", c.go)
    else:
        c.wait_for_go()
    out["shutdown_s"] = c.timed_shutdown()
    return out


def test_our_own_stall_is_not_a_dead_peer():
    res = run_workers(_stalled, 2, timeout=50)
    assert (res[0]["first"], res[0]["second"]) == (5, 7)
    assert res[0]["pipes"] == ["open"]
