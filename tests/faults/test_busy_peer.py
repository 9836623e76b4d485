"""Silence that is not death: a peer busy with a large transfer, a peer
holding its GIL, and a stall of our own.

A peer is declared dead only when the kernel says so (its lifeline closes,
transport/watch/lifeline.py); a live peer's kernel keeps answering for it however
long its process does not.  These are the false positives that design must
not have, each checked with a ``peer_timeout`` far shorter than the silence.
"""

from __future__ import annotations

import ctypes
import time

import pytest

from tests.faults import _common as c
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

NBYTES = 256 << 20
SHORT_PEER_TIMEOUT = 0.5
#: How long a callee holds its GIL: 6 x SHORT_PEER_TIMEOUT, the old silence
#: verdict's allowance many times over.
GIL_HOLD_S = 3.0


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


def hold_gil(seconds, value):
    """Sleep in one native call that keeps the GIL (a long C extension call,
    as far as the interpreter knows): no thread of this process runs Python,
    its progress and lifeline threads included."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))
    return value


def _gil_pair(rank, world_size, init_method):
    import ucxrpc as rpc

    c.init(rank, world_size, init_method, peer_timeout=SHORT_PEER_TIMEOUT)
    out = {}
    if rank == 0:
        assert rpc.rpc_sync("worker1", c.add, args=(1, 1)) == 2  # the pipe is open
        t0 = time.monotonic()
        held = rpc.rpc_async("worker1", hold_gil, args=(GIL_HOLD_S, "held"))
        behind = rpc.rpc_async("worker1", c.add, args=(2, 3))  # queued behind it
        out["held"] = c.failure(t0, held.wait)
        out["behind"] = c.failure(t0, behind.wait)
        out["after"] = rpc.rpc_sync("worker1", c.add, args=(3, 4))
        # Our own GIL held while a reply is on its way: nothing is concluded.
        fut = rpc.rpc_async("worker1", c.add, args=(4, 5))
        hold_gil(GIL_HOLD_S, None)
        out["own_hold"] = fut.wait()
        out["pipes"] = [(p["state"], p["lifeline"]) for p in rpc.get_pipe_info()]
        out["failures"] = rpc._get_debug_info()["peer_failures"]
        rpc.rpc_sync("worker1", c.go)
    else:
        c.wait_for_go()
    out["shutdown_s"] = c.timed_shutdown()
    return out


def test_peer_holding_its_gil_returns_its_value():
    res = run_workers(_gil_pair, 2, timeout=50)
    r0 = res[0]
    print(f"\n  callee held its GIL {GIL_HOLD_S} s (peer_timeout={SHORT_PEER_TIMEOUT} s): "
          f"{r0['held']}; the call behind it: {r0['behind']}")
    assert r0["held"]["value"] == "'held'" and r0["held"]["elapsed"] >= GIL_HOLD_S, r0
    assert r0["behind"]["value"] == "5", r0
    assert (r0["after"], r0["own_hold"]) == (7, 9)
    assert r0["pipes"] == [("open", "up")] and r0["failures"] == 0, r0
