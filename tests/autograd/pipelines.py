"""Pipelines trained over RPC against the same model trained in one process.

A program, run on either agent: ``python tests/autograd/pipelines.py``
trains on torch's own; ``python -m ucxrpc.torch_rpc
tests/autograd/pipelines.py`` runs it unchanged on ucxrpc.  Four processes
start once (``torch.multiprocessing.spawn``); rank 0 drives every cell of
the matrix, each cell a fresh model:

* **workers** 2, 3 or 4: the driver and one stage on each other worker (the
  model's three blocks split over them);
* **micro-batches** 1, 2, 4 or 8, each passed from stage to stage as an
  RRef (a stage fetches its input from the previous stage's worker, so the
  sends and recvs of one context cross the same workers several times);
* **checkpointing** none, torch's reentrant one or its non-reentrant one,
  around each stage's forward (FairScale: ``never``, ``except_last``,
  ``always``);
* **the loss** on the driver (outputs fetched, ``dist_autograd.backward``)
  or on the last stage (``RRef.backward``, as FairScale's
  ``DistributedLoss``).

Each step: forward, the distributed backward, ``DistributedOptimizer``
(SGD).  Each cell is compared with the same blocks, seeds and data trained
in one process on the whole batch: each step's loss and every parameter
after each step, to float tolerance (micro-batches sum gradients in
another order).  ``--fairscale`` runs FairScale 0.4.13's
``DistributedPipeline`` over the same matrix (its own checkpointing).

Prints one JSON line per cell (``{"cell": ..., "loss_err": ..., "param_err":
..., "equal": ...}``, or ``"error"`` and ``"refused"``: the error says a
reentrant checkpoint cannot run in a distributed backward pass, as both
agents say; a cell that timed out adds ``"workers"``, each worker's debug
info and thread stacks), then ``done``.  The suite runs both matrices'
cells on ucxrpc (tests/autograd/test_pipelines.py: in one start of worker
processes of the suite's own, ``torch.distributed.rpc`` swapped as the
launcher swaps it); torch's agent gives the same cells (README.md,
distributed autograd).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp
from torch import nn

WORLD = 4
WORKERS = (2, 3, 4)
MICRO_BATCHES = (1, 2, 4, 8)
CHECKPOINTS = ("never", "reentrant", "non-reentrant")
FAIRSCALE_CHECKPOINTS = ("never", "except_last", "always")
LOSSES = ("driver", "last-stage")
STEPS = 2
BATCH = 16
LR = 0.05
#: Micro-batches add gradients in another order than the whole batch does.
RTOL, ATOL = 1e-5, 1e-6

#: Blocks of the model as (inputs, outputs, activation after).
BLOCKS = ((8, 16, True), (16, 16, True), (16, 4, False))

#: Stages of this worker: (cell, stage index) -> module.
_STAGES: dict[tuple[str, int], nn.Module] = {}


class Block(nn.Module):
    """One block of the model, made from a seed so every process makes the
    same (FairScale's RemoteModule builds it on the stage's worker)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(100 + index)
        fan_in, fan_out, act = BLOCKS[index]
        self.linear = nn.Linear(fan_in, fan_out)
        self.act = nn.Tanh() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class Stage(nn.Sequential):
    """A stage's blocks, one module: FairScale gets one RemoteModule per
    stage (a partition of several is a ``RemoteSequential``, whose first
    build in a process waits for ``rpc_timeout`` on torch's agent and on
    ucxrpc alike: ``PartitionHandler.__init__`` in ``RRef.local_value``)."""

    def __init__(self, blocks: list[int]) -> None:
        super().__init__(*(Block(i) for i in blocks))


def split(stages: int) -> list[list[int]]:
    """Which blocks each of ``stages`` stages holds."""
    return {1: [[0, 1, 2]], 2: [[0, 1], [2]], 3: [[0], [1], [2]]}[stages]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def local(steps: int = STEPS) -> tuple[list[float], list[list[torch.Tensor]]]:
    """The model trained in one process: each step's loss and parameters."""
    model = nn.Sequential(*(Block(i) for i in range(len(BLOCKS))))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = data()
    losses, params = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target, reduction="sum")
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append([p.detach().clone() for p in model.parameters()])
    return losses, params


# -- on a stage's worker ------------------------------------------------------

def _make_stage(key: tuple[str, int], blocks: list[int]) -> None:
    _STAGES[key] = Stage(blocks)


def _drop_stage(key: tuple[str, int]) -> None:
    _STAGES.pop(key, None)


def _parameter_rrefs(key: tuple[str, int]) -> list:
    import torch.distributed.rpc as rpc
    return [rpc.RRef(p) for p in _STAGES[key].parameters()]


def _parameters(key: tuple[str, int]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _STAGES[key].parameters()]


def _forward(key: tuple[str, int], source, checkpoint: str) -> torch.Tensor:
    x = source.to_here()
    stage = _STAGES[key]
    if checkpoint == "never":
        return stage(x)
    from torch.utils.checkpoint import checkpoint as run
    if checkpoint == "reentrant" and not x.requires_grad:
        # The reentrant checkpoint's output requires grad only if an input
        # does (torch's documented limitation): the first stage's input is
        # data, and its parameters would get no gradient.
        x = x.detach().requires_grad_()
    return run(stage, x, use_reentrant=checkpoint == "reentrant")


def _state() -> dict:
    """This worker's agent counters and every thread's stack: what a cell
    that timed out reports of each worker (a call that never came back is
    a lost message or a stuck thread, and which one shows here)."""
    import faulthandler
    import tempfile

    import torch.distributed.rpc as rpc
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        stacks = f.read()
    return {"debug": rpc.api._get_current_rpc_agent().get_debug_info(), "stacks": stacks}


def _loss(outputs: list, target: torch.Tensor) -> torch.Tensor:
    y = torch.cat([o.to_here() for o in outputs])
    return nn.functional.mse_loss(y, target, reduction="sum")


# -- on the driver ------------------------------------------------------------

def _compare(cell: str, losses: list[float], params: list[list[torch.Tensor]],
             want: tuple[list[float], list[list[torch.Tensor]]]) -> dict:
    want_losses, want_params = want
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, want_losses))
    param_err = max(float((a - b).abs().max()) for got, exp in zip(params, want_params)
                    for a, b in zip(got, exp))
    equal = (all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, want_losses))
             and all(torch.allclose(a, b, rtol=RTOL, atol=ATOL)
                     for got, exp in zip(params, want_params) for a, b in zip(got, exp)))
    return {"cell": cell, "losses": [round(v, 6) for v in losses], "loss_err": loss_err,
            "param_err": param_err, "equal": equal}


def _own_cell(cell: str, workers: int, micro: int, checkpoint: str, loss_at: str) -> dict:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    stages = [(f"worker{k + 1}", (cell, k), blocks)
              for k, blocks in enumerate(split(workers - 1))]
    for name, key, blocks in stages:
        rpc.rpc_sync(name, _make_stage, (key, blocks))
    try:
        rrefs = [r for name, key, _ in stages
                 for r in rpc.rpc_sync(name, _parameter_rrefs, (key,))]
        opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=LR)
        x, target = data()
        last = stages[-1][0]
        losses, params = [], []
        for _ in range(STEPS):
            with dist_autograd.context() as ctx:
                outputs = []
                for chunk in x.chunk(micro):
                    ref = rpc.RRef(chunk)
                    for name, key, _ in stages:
                        ref = rpc.remote(name, _forward, (key, ref, checkpoint))
                    outputs.append(ref)
                if loss_at == "driver":
                    y = torch.cat([o.to_here() for o in outputs])
                    loss = nn.functional.mse_loss(y, target, reduction="sum")
                    dist_autograd.backward(ctx, [loss])
                    value = loss.item()
                else:
                    loss_ref = rpc.remote(last, _loss, (outputs, target))
                    loss_ref.backward(ctx)
                    value = loss_ref.to_here().item()
                opt.step(ctx)
            losses.append(value)
            params.append([p for name, key, _ in stages
                           for p in rpc.rpc_sync(name, _parameters, (key,))])
        return _compare(cell, losses, params, local())
    finally:
        for name, key, _ in stages:
            rpc.rpc_sync(name, _drop_stage, (key,))


def _fairscale_cell(cell: str, workers: int, micro: int, checkpoint: str,
                    loss_at: str) -> dict:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from fairscale.experimental.nn.distributed_pipeline import (DistributedLoss,
                                                                DistributedPipeline,
                                                                PipelineModulesGraph)
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer

    modules = [RemoteModule(f"worker{k + 1}/cpu", Stage, (blocks,))
               for k, blocks in enumerate(split(workers - 1))]
    graph = PipelineModulesGraph()
    graph.add_sequence(modules, [0])
    pipe = DistributedPipeline(graph, chunks=micro, checkpoint=checkpoint)
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=LR)
    criterion = DistributedLoss(nn.MSELoss, reduction="sum")
    x, target = data()
    losses, params = [], []
    for _ in range(STEPS):
        with dist_autograd.context() as ctx:
            if loss_at == "driver":
                y = pipe(x).to_here()
                loss = nn.functional.mse_loss(y, target, reduction="sum")
                dist_autograd.backward(ctx, [loss])
                value = loss.item()
            else:
                loss_ref = criterion(pipe(x), rpc.RRef(target))
                loss_ref.backward(ctx)
                value = loss_ref.to_here().item()
            opt.step(ctx)
        losses.append(value)
        params.append([p.to_here().detach().clone() for p in pipe.parameter_rrefs()])
    return _compare(cell, losses, params, local())


def cells(fairscale: bool = False, only: str = "", repeat: int = 1) -> Iterator[dict]:
    """On the driver (worker0, RPC up on all four): each cell's report."""
    cell = _fairscale_cell if fairscale else _own_cell
    checkpoints = FAIRSCALE_CHECKPOINTS if fairscale else CHECKPOINTS
    matrix = itertools.product(WORKERS, MICRO_BATCHES, checkpoints, LOSSES)
    for args in [args for args in matrix for _ in range(repeat)]:
        if only and only not in " ".join(map(str, args)):  # e.g. '3 4 never'
            continue
        started = time.monotonic()
        label = "{} workers={} micro={} checkpoint={} loss={}".format(
            "fairscale" if fairscale else "own", *args)
        try:
            report = cell(label, *args)
        except Exception as e:  # noqa: BLE001 - a cell's failure is its result
            error = f"{type(e).__name__}: {e}"
            report = {"cell": label, "error": error[:2000],
                      "equal": False, "refused": "use_reentrant=True" in error}
            if "timeout" in error.lower():
                report["workers"] = _states()
        report["seconds"] = round(time.monotonic() - started, 2)
        yield report


def _states() -> dict:
    """Every worker's :func:`_state` (or why it could not be had)."""
    import torch.distributed.rpc as rpc
    out = {}
    for rank in range(WORLD):
        try:
            out[f"worker{rank}"] = rpc.rpc_sync(f"worker{rank}", _state, timeout=10)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            out[f"worker{rank}"] = f"{type(e).__name__}: {e}"
    return out


def run(rank: int, port: int, fairscale: bool, only: str, repeat: int) -> None:
    import torch.distributed.rpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=60))
    if rank == 0:
        for report in cells(fairscale, only, repeat):
            print(json.dumps(report), flush=True)
        print("done", flush=True)
    rpc.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--fairscale", action="store_true",
                        help="FairScale's DistributedPipeline, not the pipeline of our own")
    parser.add_argument("--only", default="",
                        help="cells whose arguments contain this text, e.g. '3 4 never'")
    parser.add_argument("--repeat", type=int, default=1, help="run each cell this many times")
    args = parser.parse_args(argv)
    mp.spawn(run, args=(args.port, args.fairscale, args.only, args.repeat), nprocs=WORLD,
             join=True)


if __name__ == "__main__":
    sys.exit(main())
