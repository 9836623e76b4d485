"""A parameter server and two trainers sharing its model.

The model lives on the "ps" worker.  Each trainer runs the forward pass on
the server (rpc_sync), computes its loss locally, runs the distributed
backward pass, and steps a DistributedOptimizer over the server's
parameters; the two trainers do so concurrently, each in its own autograd
context.

    python examples/parameter_server.py            # three local processes
    torchrun --nproc-per-node 3 examples/parameter_server.py
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

import ucxrpc as rpc
import ucxrpc.autograd as dist_autograd
from ucxrpc.optim import DistributedOptimizer
from _launch import launch

STEPS = 20
_model: nn.Module | None = None
_model_lock = threading.Lock()


def server_model() -> nn.Module:
    global _model
    with _model_lock:
        if _model is None:
            torch.manual_seed(0)
            _model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
        return _model


def forward(x: torch.Tensor) -> torch.Tensor:
    # On a snapshot of the weights: the other trainer's optimizer step updates
    # them in place while this trainer's backward pass still needs the values
    # its forward pass used.  clone() is differentiable, so the gradients still
    # reach the parameters themselves.
    first, _, last = server_model()
    h = F.relu(F.linear(x, first.weight.clone(), first.bias.clone()))
    return F.linear(h, last.weight.clone(), last.bias.clone())


def parameter_rrefs() -> list[rpc.RRef[torch.Tensor]]:
    return [rpc.RRef(p) for p in server_model().parameters()]


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Points labelled by which side of a fixed plane they fall on."""
    x = torch.randn(64, 10, generator=gen)
    return x, (x[:, :3].sum(dim=1) > 0).long()


def train(name: str, seed: int) -> None:
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("ps", parameter_rrefs),
                               lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for step in range(STEPS):
        x, y = batch(gen)
        with dist_autograd.context() as context_id:
            logits = rpc.rpc_sync("ps", forward, (x,))
            loss = F.cross_entropy(logits, y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        print(f"{name} step {step:2d} loss {loss.item():.4f}", flush=True)


def main(rank: int, world_size: int) -> None:
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    if rank > 0:
        train(name, seed=rank)
    rpc.shutdown()  # waits for everyone: the server serves until the trainers are done


if __name__ == "__main__":
    launch(main, world_size=3)
