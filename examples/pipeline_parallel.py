"""A two-stage pipeline-parallel model.

Stage 1 runs on worker "stage1", stage 2 on "stage2"; the driver feeds
micro-batches and owns the loss.  Activations go from stage 1 to stage 2
directly, as RRefs (the driver never holds them), and every micro-batch is in
flight at once, so stage 1 works on one micro-batch while stage 2 works on
another.  One distributed backward pass and one DistributedOptimizer step per
batch train both stages.

    python examples/pipeline_parallel.py           # three local processes
    torchrun --nproc-per-node 3 examples/pipeline_parallel.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import ucxrpc as rpc
import ucxrpc.autograd as dist_autograd
from ucxrpc.nn import RemoteModule
from ucxrpc.optim import DistributedOptimizer
from _launch import launch

STEPS = 15
MICRO_BATCHES = 4


class Stage(nn.Module):
    """A stage takes its input as an RRef, wherever that input lives."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh())

    def forward(self, x_rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
        return self.net(x_rref.to_here())


class Pipeline:
    def __init__(self) -> None:
        self.stage1 = RemoteModule("stage1/cpu", Stage, (16, 32, 1))
        self.stage2 = RemoteModule("stage2/cpu", Stage, (32, 4, 2))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk in x.chunk(MICRO_BATCHES):
            # Stage 1's output stays on stage1; stage 2 fetches it from there.
            hidden = self.stage1.get_module_rref().remote().forward(rpc.RRef(chunk))
            outputs.append(self.stage2.get_module_rref().rpc_async().forward(hidden))
        return torch.cat(torch.futures.wait_all(outputs))

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        return self.stage1.remote_parameters() + self.stage2.remote_parameters()


def drive() -> None:
    model = Pipeline()
    opt = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=0.02)
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 4, generator=gen)
    for step in range(STEPS):
        x = torch.randn(128, 16, generator=gen)
        y = torch.tanh(x @ teacher)
        with dist_autograd.context() as context_id:
            loss = F.mse_loss(model(x), y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        print(f"step {step:2d} loss {loss.item():.4f}", flush=True)


def main(rank: int, world_size: int) -> None:
    rpc.init_rpc(["driver", "stage1", "stage2"][rank], rank=rank, world_size=world_size)
    if rank == 0:
        drive()
    rpc.shutdown()


if __name__ == "__main__":
    launch(main, world_size=3)
