"""A peer SIGKILLed during a distributed backward pass.

worker0's forward pass goes through worker1 and the victim (worker2); the
victim's part of the graph kills its process when the gradients reach it.
``backward`` fails naming worker2; as in torch, the context stays on the
survivors until its ``with`` block ends, and a new context with worker1
works.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.faults import _common as c
from tests.workers import run_with_victim

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

class DieInBackward(torch.autograd.Function):
    """The identity, whose backward kills the process running it."""

    @staticmethod
    def forward(ctx, x, stamp_path):
        ctx.stamp_path = stamp_path
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        c.kill_self(ctx.stamp_path)
        return grad, None  # not reached


def die_in_backward(x, stamp_path):
    return DieInBackward.apply(x, stamp_path) * 3.0


def double(x):
    return x * 2.0


def num_contexts():
    return c.debug_info()["num_autograd_contexts"]


def _third_contexts_once_released(timeout=10.0):
    import ucxrpc as rpc

    end = time.monotonic() + timeout
    while (n := rpc.rpc_sync(c.THIRD, num_contexts)) and time.monotonic() < end:
        time.sleep(0.05)
    return n


def _survivor(rank, world_size, init_method, full_world, stamp_path):
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    c.init(rank, full_world, init_method)
    out = {}
    if rank == 0:
        x = torch.rand(4, requires_grad=True)
        with dist_autograd.context() as ctx:
            a = rpc.rpc_sync(c.THIRD, double, args=(x,))
            b = rpc.rpc_sync(c.VICTIM, die_in_backward, args=(x, stamp_path))
            loss = (a + b).sum()
            out["contexts_during"] = (num_contexts(), rpc.rpc_sync(c.THIRD, num_contexts))
            start = time.monotonic()
            out["backward"] = c.failure(start, dist_autograd.backward, ctx, [loss])
            out["backward"]["elapsed"] -= c.read_stamp(stamp_path) - start  # from the kill
            # A failed pass leaves the context where it is (torch's rule).
            out["third_contexts_after_failure"] = rpc.rpc_sync(c.THIRD, num_contexts)
        # Leaving the block sends the release, without waiting for it.
        out["contexts_after"] = (num_contexts(), _third_contexts_once_released())
        # A new pass through worker1 alone works, with the right gradients.
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync(c.THIRD, double, args=(x,)).sum()
            dist_autograd.backward(ctx, [loss])
            grad = dist_autograd.get_gradients(ctx)[x]
            assert torch.equal(grad, torch.full_like(x, 2.0)), grad
        out["contexts_end"] = (num_contexts(), rpc.rpc_sync(c.THIRD, num_contexts))
    return c.finish(rank, out)


def test_peer_killed_during_backward(tmp_path):
    stamp = str(tmp_path / "killed-at")
    res = run_with_victim(c.victim_main, _survivor, c.WORLD, args=(c.WORLD, stamp), timeout=80)
    r0 = res[0]
    print(f"\n  SIGKILL during backward (contexts on worker0, worker1: during the pass "
          f"{r0['contexts_during']}, after the with block {r0['contexts_after']}):")
    c.check_failure(r0["backward"], c.VICTIM, "backward")
    assert "DistAutogradError" in r0["backward"]["classes"], r0["backward"]
    assert r0["contexts_during"] == (1, 1)
    assert r0["third_contexts_after_failure"] == 1
    assert r0["contexts_after"] == (0, 0)
    assert r0["contexts_end"] == (0, 0)
    for rank, r in enumerate(res):
        c.check_shutdown(r["shutdown_s"], f"worker{rank}")
