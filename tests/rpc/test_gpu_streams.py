"""Stream discipline where no CPU can show it: kernels still queued when a
value changes hands (two processes sharing one GPU).

Each producer queues ``torch.cuda._sleep`` (about 100 ms) ahead of the
kernel that writes the value, so a reader on a stream that does not wait for
the producer's sees zeros.  From the CUDA review of 2026-11-23 (its probes 2
to 5; "5.x" below is its §1.5 item): the reply path was right already; an
RRef value, a call to oneself, and distributed autograd or RemoteModule
replies on a worker with CUDA devices were not.  Marked ``gpu``: run with
``python -m pytest -m gpu -rs`` and check that nothing was skipped.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.rpc._gpu import BOTH, N, SPIN, checksum, init, slow_fives
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.gpu, pytest.mark.timeout(180)]


# The callee's result is still being written when the function returns: the
# reply must wait for the callee's stream.
def _reply_stream(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        out = checksum(rpc.rpc_sync("worker1", slow_fives, (N,)))
    rpc.shutdown()
    return out


def test_reply_waits_for_the_callees_stream():
    assert run_workers(_reply_stream, 2, timeout=150)[0] == 5.0 * N


# 5.b: remote() runs the function on another pool thread; to_here is served
# on a pool stream of its own, which must wait for the value's work.
def _rref_race(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        r = rpc.remote("worker1", slow_fives, (N,))
        time.sleep(0.02)  # the value is set, its kernels still queued
        out = checksum(r.to_here())
    rpc.shutdown()
    return out


def test_rref_value_is_complete_when_fetched():
    assert run_workers(_rref_race, 2, timeout=150)[0] == 5.0 * N


# 5.b: a proxy's method runs on the owner on the proxy call's streams, and
# local_value() on the owner is read on its caller's (here a served call's).
def local_checksum(rref):
    return checksum(rref.local_value())


def _rref_proxy_and_local(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        r = rpc.remote("worker1", slow_fives, (N,))
        time.sleep(0.02)
        via_proxy = checksum(r.rpc_sync().double())
        r = rpc.remote("worker1", slow_fives, (N,))
        time.sleep(0.02)
        on_owner = rpc.rpc_sync("worker1", local_checksum, (r,))
        out = (via_proxy, on_owner)
    rpc.shutdown()
    return out


def test_rref_proxy_and_local_value_see_the_finished_value():
    assert run_workers(_rref_proxy_and_local, 2, timeout=150)[0] == (5.0 * N, 5.0 * N)


# 5.a: a call to oneself clones the arguments on the caller's stream; the
# callee reads them on a pool stream.
def _loopback(rank, world_size, init_method):
    import ucxrpc as rpc

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        t = torch.zeros(N, device="cuda")
        torch.cuda._sleep(SPIN)
        t.add_(3)
        out = rpc.rpc_sync("worker0", checksum, (t,))
    rpc.shutdown()
    return out


def test_call_to_self_sees_the_callers_pending_work():
    assert run_workers(_loopback, 2, timeout=150)[0] == 3.0 * N


# Finding 1: a CUDA-aware future pickles its value with torch's
# _extract_tensors, which an autograd _Reply and ucxrpc RRefs refused.
def _autograd_rpc(rank, world_size, init_method):
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        x = torch.randn(64, device="cuda", requires_grad=True)
        with dist_autograd.context() as ctx:
            y = rpc.rpc_sync("worker1", torch.mul, (x, 3.0))
            dist_autograd.backward(ctx, [(y * y).sum()])
            out = bool(torch.allclose(dist_autograd.get_gradients(ctx)[x], 18 * x.detach()))
    rpc.shutdown()
    return out


def test_dist_autograd_rpc_from_a_cuda_worker():
    assert run_workers(_autograd_rpc, 2, timeout=150)[0] is True


def _remote_params(rank, world_size, init_method):
    import ucxrpc as rpc
    from ucxrpc.nn import RemoteModule

    init(rank, world_size, init_method, BOTH)
    out = None
    if rank == 0:
        rm = RemoteModule("worker1/cuda:0", torch.nn.Linear, args=(8, 4))
        out = len(rm.remote_parameters())
    rpc.shutdown()
    return out


def test_remote_parameters_from_a_cuda_worker():
    assert run_workers(_remote_params, 2, timeout=150)[0] == 2

