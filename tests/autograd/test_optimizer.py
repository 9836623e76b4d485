"""DistributedOptimizer over RemoteModules on two owners, against the same
model trained in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.workers import worker_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


class Stage(nn.Module):
    """A layer whose initial weights depend only on ``seed``."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(d_in, d_out, dtype=torch.float64)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(d_out, d_in, generator=g, dtype=torch.float64) * 0.3)
            self.fc.bias.copy_(torch.randn(d_out, generator=g, dtype=torch.float64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


OPTIMIZERS = [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              (torch.optim.Adam, {"lr": 0.01}),
              (torch.optim.RMSprop, {"lr": 0.01})]


def _data():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(16, 4, generator=g, dtype=torch.float64),
            torch.randn(16, 1, generator=g, dtype=torch.float64))


def _reference(optimizer_class, kwargs, steps):
    x, y = _data()
    stages = [Stage(4, 8, 1), Stage(8, 6, 2), Stage(6, 1, 3)]
    params = [p for s in stages for p in s.parameters()]
    opt = optimizer_class(params, **kwargs)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = x
        for s in stages:
            out = s(out)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in params]


def _workers_up(rank, world_size, init_method):
    """A group's rank: up as ``worker{rank}`` until the module's last test."""
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    yield
    rpc.shutdown()


trio = worker_group(_workers_up, 3)


def _pipeline(optimizer_name, kwargs):
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.nn import RemoteModule
    from ucxrpc.optim import DistributedOptimizer

    optimizer_class = getattr(torch.optim, optimizer_name)
    steps = 5
    x, y = _data()
    s1 = RemoteModule("worker1/cpu", Stage, (4, 8, 1))
    s2 = RemoteModule("worker2/cpu", Stage, (8, 6, 2))
    head = Stage(6, 1, 3)
    params = s1.remote_parameters() + s2.remote_parameters() + \
        [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(optimizer_class, params, **kwargs)
    losses = []
    for _ in range(steps):
        with dist_autograd.context() as ctx:
            loss = ((head(s2(s1(x))) - y) ** 2).mean()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
            losses.append(loss.item())
        assert all(p.grad is None for p in head.parameters())
    want_losses, want_params = _reference(optimizer_class, kwargs, steps)
    assert losses == pytest.approx(want_losses, rel=1e-9), optimizer_class
    got = [p.to_here() for p in params]
    for g, w in zip(got, want_params):
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-12), optimizer_class
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("optimizer_class, kwargs", OPTIMIZERS,
                         ids=[cls.__name__ for cls, _ in OPTIMIZERS])
def test_optimizers_match_local_training(trio, optimizer_class, kwargs):
    trio.run(_pipeline, optimizer_class.__name__, kwargs)


def _errors():
    from ucxrpc.nn import RemoteModule
    from ucxrpc.optim import DistributedOptimizer

    s1 = RemoteModule("worker1/cpu", Stage, (4, 8, 1))
    # errors: the optimizer's own, at creation, with its type; an unknown context
    with pytest.raises(ValueError, match="Invalid learning rate"):
        DistributedOptimizer(torch.optim.SGD, s1.remote_parameters(), lr=-1.0)
    with pytest.raises(RuntimeError, match=r"(?s)worker1.*Could not find autograd context"):
        DistributedOptimizer(torch.optim.SGD, s1.remote_parameters(), lr=0.1).step(999)


def test_an_optimizers_errors_come_back_with_their_type(trio):
    trio.run(_errors)
