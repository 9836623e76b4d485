"""RRef, distributed autograd, DistributedOptimizer and RemoteModule with CUDA
tensors and parameters, which torch's RPC refuses.  Two processes share one
GPU.  Marked ``gpu``: run with ``python -m pytest -m gpu`` on a GPU machine.

Where a claim is about streams, the producer queues ``torch.cuda._sleep``
ahead of the kernel that writes the value, so that a reader that does not
wait for the producer's stream sees the wrong numbers."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tests.rpc._gpu import SPIN, checksum
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.gpu, pytest.mark.timeout(180)]

MAPS = {0: {"worker1": {0: 0}}, 1: {"worker0": {0: 0}}}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def sevens(n):
    """Sevens, still being written when the function returns."""
    x = torch.zeros(n, device="cuda")
    torch.cuda._sleep(SPIN)
    return x.add_(7)


class SlowGrad(torch.autograd.Function):
    """``2 * x`` whose backward queues SPIN cycles ahead of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(SPIN)
        return g * 2


_W: dict[str, torch.Tensor] = {}


def weight(n=1 << 20):
    """worker1's parameter: made once, threes."""
    w = _W.get("w")
    if w is None:
        w = _W.setdefault("w", torch.full((n,), 3.0, device="cuda", requires_grad=True))
    return w


def weighted(x):
    return SlowGrad.apply(weight()) * x


def weight_rrefs():
    from ucxrpc import RRef

    return [RRef(weight())]


def grad_checksum(ctx):
    import ucxrpc.autograd as dist_autograd

    return checksum(dist_autograd.get_gradients(ctx)[weight()])


def weight_checksum():
    return checksum(weight().detach())


def _cuda(rank, world_size, init_method):
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.nn import RemoteModule
    from ucxrpc.optim import DistributedOptimizer

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method,
                                                              device_maps=MAPS[rank]))
    if rank == 0:
        # an RRef to a CUDA value, fetched while its kernels are still queued
        r = rpc.remote("worker1", sevens, (1 << 20,))
        time.sleep(0.02)
        v = r.to_here()
        assert v.device == torch.device("cuda:0") and torch.equal(v, torch.full_like(v, 7.0))
        # gradients accumulated on one stream of worker1, read on others: by
        # get_gradients there, then by an optimizer step, whose update the
        # next call (on yet another stream) sees once step() returned
        n = 1 << 20
        opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("worker1", weight_rrefs), lr=1.0)
        ones = torch.ones(n, device="cuda")
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [rpc.rpc_sync("worker1", weighted, (ones,)).sum()])
            assert rpc.rpc_sync("worker1", grad_checksum, (ctx,)) == 2.0 * n
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [rpc.rpc_sync("worker1", weighted, (ones,)).sum()])
            opt.step(ctx)
        assert rpc.rpc_sync("worker1", weight_checksum) == 1.0 * n  # 3 - 1.0 * 2
        # distributed autograd over CUDA tensors
        x = torch.randn(64, device="cuda", requires_grad=True)
        with dist_autograd.context() as ctx:
            y = rpc.rpc_sync("worker1", torch.mul, (x, 3.0))
            dist_autograd.backward(ctx, [(y * y).sum()])
            g = dist_autograd.get_gradients(ctx)[x]
        assert g.device == x.device and torch.allclose(g, 18 * x.detach())
        # RemoteModule on the GPU, trained by a DistributedOptimizer; same as locally
        rm = RemoteModule("worker1/cuda:0", Net)
        local = Net().cuda()
        opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(local.parameters(), lr=0.1)
        data = torch.randn(16, 8, device="cuda")
        for _ in range(3):
            with dist_autograd.context() as ctx:
                loss = rm(data).pow(2).mean()
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            ref_opt.zero_grad()
            ref = local(data).pow(2).mean()
            ref.backward()
            ref_opt.step()
            assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
        for p, q in zip(rm.remote_parameters(), local.parameters()):
            got = p.to_here()
            assert got.device == torch.device("cuda:0")
            assert torch.allclose(got, q.detach(), rtol=1e-5, atol=1e-6)
    rpc.shutdown()


def test_rref_autograd_optimizer_and_remote_module_on_cuda():
    run_workers(_cuda, 2, timeout=150)
