"""RRef, distributed autograd, DistributedOptimizer and RemoteModule with CUDA
tensors and parameters, which torch's RPC refuses.  Two processes share one
GPU.  Marked ``gpu``: run with ``python -m pytest -m gpu`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.workers import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

MAPS = {0: {"worker1": {0: 0}}, 1: {"worker0": {0: 0}}}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def sevens(n):
    return torch.full((n,), 7.0, device="cuda")


def _cuda(rank, world_size, init_method):
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.nn import RemoteModule
    from ucxrpc.optim import DistributedOptimizer

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method,
                                                              device_maps=MAPS[rank]))
    if rank == 0:
        # an RRef to a CUDA value
        r = rpc.remote("worker1", sevens, (1000,))
        v = r.to_here()
        assert v.device == torch.device("cuda:0") and torch.equal(v, torch.full_like(v, 7.0))
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
