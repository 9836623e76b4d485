"""FairScale's ``DistributedPipeline``, unmodified, on ucxrpc.

Two stages of ``RemoteModule`` layers on worker1 and worker2, driven from
worker0: the batch in micro-batches (``chunks``), ``DistributedLoss``,
``RRef.backward`` and ``DistributedOptimizer``.  FairScale imports
``torch.distributed.rpc`` itself, so run it under the launcher, which reaches
the workers ``torch.multiprocessing.spawn`` starts::

    pip install --no-deps fairscale==0.4.13
    python -m ucxrpc.torch_rpc examples/libraries/fairscale_pipeline.py [port] [chunks]

Without ``-m ucxrpc.torch_rpc`` the same file runs on torch's own agent.
Prints each step's loss, then the same model trained in one process: the
two lines should be the same.
"""

import os
import sys

import torch
import torch.multiprocessing as mp
from torch import nn

STEPS = 5
LR = 0.05


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def run(rank: int, world_size: int, port: int, chunks: int) -> None:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from fairscale.experimental.nn.distributed_pipeline import (DistributedLoss,
                                                                DistributedPipeline,
                                                                PipelineModulesGraph)
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer

    torch.manual_seed(0)  # each worker makes its layers from the same seed
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 backend=rpc.BackendType.TENSORPIPE,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(_transports=["uv"]))
    if rank == 0:
        graph = PipelineModulesGraph()
        graph.add_sequence([RemoteModule("worker1/cpu", nn.Linear, (8, 16)),
                            RemoteModule("worker1/cpu", nn.ReLU, ()),
                            RemoteModule("worker2/cpu", nn.Linear, (16, 4))], [0])
        pipe = DistributedPipeline(graph, chunks=chunks)
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
        criterion = DistributedLoss(nn.MSELoss, reduction="sum")
        x, target = data()
        losses = []
        for _ in range(STEPS):
            with dist_autograd.context() as ctx:
                loss = criterion(pipe(x), rpc.RRef(target))
                loss.backward(ctx)
                opt.step(ctx)
                losses.append(loss.to_here().item())
        ours = (rpc.__doc__ or "").startswith("ucxrpc")
        print(f"{'ucxrpc' if ours else 'torch'} losses", " ".join(f"{v:.4f}" for v in losses),
              flush=True)
    rpc.shutdown()


def local() -> list[float]:
    """The same layers, data and optimizer in one process."""
    torch.manual_seed(0)
    first = nn.Linear(8, 16)
    torch.manual_seed(0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.MSELoss(reduction="sum")(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29761
    chunks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    mp.spawn(run, args=(3, port, chunks), nprocs=3, join=True)
    print("local losses", " ".join(f"{v:.4f}" for v in local()), flush=True)
