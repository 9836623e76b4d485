"""RemoteModule on a real second worker: forward, parameters, training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.workers import worker_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


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


def _workers_up(rank, world_size, init_method):
    """A group's rank: up as ``worker{rank}`` until the module's last test."""
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    yield
    rpc.shutdown()


trio = worker_group(_workers_up, 3)


def _data():
    torch.manual_seed(1)
    return torch.randn(16, 4), torch.randn(16, 3)


def _forward():
    from ucxrpc.nn import RemoteModule

    x, _ = _data()
    local = Net(4, 3)
    for form in ("worker1/cpu", "rank:1/cpu"):
        rm = RemoteModule(form, Net, args=(4,), kwargs={"d_out": 3})
        assert rm.on.name == "worker1"
        assert torch.allclose(rm(x, scale=2.0), local(x, scale=2.0))
        assert torch.allclose(rm.forward_async(x).wait(), local(x))


def test_forward_on_the_owner_named_either_way(trio):
    trio.run(_forward)


def _remote_parameters():
    from ucxrpc.nn import RemoteModule

    local = Net(4, 3)
    rm = RemoteModule("rank:1/cpu", Net, args=(4,), kwargs={"d_out": 3})
    params = rm.remote_parameters()
    assert len(params) == 2 and all(p.owner_name() == "worker1" for p in params)
    assert torch.equal(params[0].to_here(), local.fc.weight.detach())


def test_remote_parameters_are_rrefs_on_the_owner(trio):
    trio.run(_remote_parameters)


def _training():
    import ucxrpc as rpc
    from ucxrpc.nn import RemoteModule

    x, y = _data()
    local = Net(4, 3)
    rm = RemoteModule("worker1/cpu", Net, args=(4,), kwargs={"d_out": 3})
    # a few training steps there match the same steps here
    mref = rm.get_module_rref()
    ref_losses = []
    for _ in range(5):
        ref_losses.append(sgd_step(rpc.RRef(local), x, y, 0.1))
    losses = [rpc.rpc_sync("worker1", sgd_step, args=(mref, x, y, 0.1)) for _ in range(5)]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert torch.allclose(rm(x), local(x))


def test_training_steps_there_match_the_same_steps_here(trio):
    trio.run(_training)


def _train_and_eval():
    import ucxrpc as rpc
    from ucxrpc.nn import RemoteModule

    rm = RemoteModule("worker1/cpu", Net, args=(4,), kwargs={"d_out": 3})
    mref = rm.get_module_rref()
    rm.eval()
    assert rpc.rpc_sync("worker1", is_training, args=(mref,)) is False
    rm.train()
    assert rpc.rpc_sync("worker1", is_training, args=(mref,)) is True


def test_eval_and_train_reach_the_owners_module(trio):
    trio.run(_train_and_eval)


def _refusals():
    from ucxrpc.nn import RemoteModule

    rm = RemoteModule("worker1/cpu", Net, args=(4,), kwargs={"d_out": 3})
    for name in ("parameters", "to", "state_dict", "cuda"):
        with pytest.raises(ValueError, match=f"Method ``{name}`` not supported"):
            getattr(rm, name)()
    with pytest.raises(ValueError, match="remote_device must look like"):
        RemoteModule("", Net, args=(4, 3))
    with pytest.raises(TypeError):  # the constructor's own error, raised here
        RemoteModule("worker1/cpu", Net, args=(4,))


def test_unsupported_methods_and_bad_construction_are_refused(trio):
    trio.run(_refusals)


class NotAModule:
    def __init__(self, *args, **kwargs) -> None:
        pass


def remote_module_attributes(remote_module):
    return sorted(remote_module.__dict__)


def forward_there(remote_module, x):
    return remote_module(x)


def share_module(on, module_rref):
    from ucxrpc.nn import RemoteModule

    return RemoteModule.init_from_module_rref(on, module_rref)


def _send_and_share():
    import pickle

    import ucxrpc as rpc
    from ucxrpc.nn import RemoteModule

    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` "
                                         r"returns an instance of <class nn.Module>, "
                                         r"but it returns an instance of .*NotAModule"):
        RemoteModule("worker1/cpu", NotAModule, args=(1,))
    rm = RemoteModule("worker1/cpu", Net, args=(4, 3))
    expected = rm(x)
    # sent over RPC (to its owner and to a third worker), less the
    # attributes added after construction
    rm.new_attr = 1
    for to in ("worker1", "worker2"):
        attrs = rpc.rpc_sync(to, remote_module_attributes, (rm,))
        assert "new_attr" not in attrs and "module_rref" in attrs, attrs
        assert torch.equal(rpc.rpc_sync(to, forward_there, (rm, x)), expected)
    # ... but never outside RPC
    with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
        pickle.dumps(rm)
    # a RemoteModule built on worker2 from rm's module RRef: calls reach
    # the same module, on worker1; it comes back here as a result
    shared = rpc.rpc_sync("worker2", share_module, ("worker2/cpu", rm.get_module_rref()))
    assert shared.on.name == "worker1" and shared.device == "cpu"
    assert torch.equal(shared(x), expected)
    local = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
    assert torch.equal(local.forward_async(x).wait(), expected)


def test_remote_module_over_rpc_and_from_module_rref(trio):
    trio.run(_send_and_share)
