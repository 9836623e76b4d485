"""RemoteModule on a real second worker: forward, parameters, training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.workers import run_workers

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * scale


def sgd_step(module_rref, x, y, lr):
    """One training step on the owner, through the module's RRef."""
    module = module_rref.local_value()
    module.zero_grad()
    loss = ((module(x) - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
    return loss.item()


def is_training(module_rref):
    return module_rref.local_value().training


def _remote_module(rank, world_size, init_method):
    import ucxrpc as rpc
    from ucxrpc.nn import RemoteModule

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    if rank == 0:
        torch.manual_seed(1)
        x, y = torch.randn(16, 4), torch.randn(16, 3)
        local = Net(4, 3)
        for form in ("worker1/cpu", "rank:1/cpu"):
            rm = RemoteModule(form, Net, args=(4,), kwargs={"d_out": 3})
            assert rm.on.name == "worker1"
            assert torch.allclose(rm(x, scale=2.0), local(x, scale=2.0))
            assert torch.allclose(rm.forward_async(x).wait(), local(x))
        params = rm.remote_parameters()
        assert len(params) == 2 and all(p.owner_name() == "worker1" for p in params)
        assert torch.equal(params[0].to_here(), local.fc.weight.detach())
        # a few training steps there match the same steps here
        mref = rm.get_module_rref()
        ref_losses = []
        for _ in range(5):
            ref_losses.append(sgd_step(rpc.RRef(local), x, y, 0.1))
        losses = [rpc.rpc_sync("worker1", sgd_step, args=(mref, x, y, 0.1)) for _ in range(5)]
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert torch.allclose(rm(x), local(x))
        rm.eval()
        assert rpc.rpc_sync("worker1", is_training, args=(mref,)) is False
        rm.train()
        assert rpc.rpc_sync("worker1", is_training, args=(mref,)) is True
        for name in ("parameters", "to", "state_dict", "cuda"):
            with pytest.raises(ValueError, match=f"Method ``{name}`` not supported"):
                getattr(rm, name)()
        with pytest.raises(ValueError, match="remote_device must look like"):
            RemoteModule("", Net, args=(4, 3))
        with pytest.raises(TypeError):  # the constructor's own error, raised here
            RemoteModule("worker1/cpu", Net, args=(4,))
        del rm, params, mref
    rpc.shutdown()


def test_remote_module_forward_parameters_and_training():
    run_workers(_remote_module, 2, timeout=100)
