#!/usr/bin/env python
"""One distributed training step, ucxrpc against torch's TensorPipe agent.

Two processes on this host: a driver and a stage worker that owns a stack of
linear layers.  A step is what a model-parallel trainer does each batch:

    with context() as ctx:
        loss = rpc_sync(stage, forward, (x,)).sum()   # activations there and back
        backward(ctx, [loss])                          # gradients there and back
        DistributedOptimizer.step(ctx)                 # one more round trip

Both implementations run the same code (only the imported modules differ),
interleaved, ``--repeat`` times each; the table gives the median step time
and the ratio ucxrpc / torch (below 1: ucxrpc is faster).  Raw ucxx has no
autograd, so there is no ceiling column here: see bench_rpc.py for the
transport.

    python benchmarks/bench_autograd.py              # about 4 minutes
    python benchmarks/bench_autograd.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ucxrpc._launch import free_port  # noqa: E402  (after the path)

# (name, batch, width, layers): activations are batch x width float32.
CASES = [("small: 32x64, 2 layers", 32, 64, 2),
         ("medium: 256x512, 4 layers", 256, 512, 4),
         ("large: 1024x1024, 4 layers (4 MiB activations)", 1024, 1024, 4)]

_stage = None


def _forward(x):
    return _stage(x)


def _param_rrefs(rpc_module):
    return [rpc_module.RRef(p) for p in _stage.parameters()]


def _modules(impl):
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
        return rpc, dist_autograd, DistributedOptimizer, rpc.TensorPipeRpcBackendOptions
    import ucxrpc as rpc
    import ucxrpc.autograd as dist_autograd
    from ucxrpc.optim import DistributedOptimizer
    return rpc, dist_autograd, DistributedOptimizer, rpc.UcxRpcBackendOptions


def _stage_params(impl):
    rpc, *_ = _modules(impl)
    return _param_rrefs(rpc)


def _build(width, layers):
    global _stage
    import torch
    torch.manual_seed(0)
    _stage = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _child(impl, rank, port, case, warmup, steps, out):
    import torch
    # No set_num_threads(1): torch's RPC threads ignore it (its stage then
    # computes on every core while ucxrpc's would keep to one).
    warnings.filterwarnings("ignore")
    rpc, dist_autograd, DistributedOptimizer, Options = _modules(impl)
    _, batch, width, layers = case
    _build(width, layers)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=Options(init_method=f"tcp://127.0.0.1:{port}",
                                             num_worker_threads=8))
    try:
        if rank == 0:
            opt = DistributedOptimizer(torch.optim.SGD,
                                       rpc.rpc_sync("worker1", _stage_params, (impl,)), lr=1e-4)
            x = torch.randn(batch, width)

            def step():
                t0 = time.perf_counter()
                with dist_autograd.context() as ctx:
                    loss = rpc.rpc_sync("worker1", _forward, (x,)).sum()
                    dist_autograd.backward(ctx, [loss])
                    opt.step(ctx)
                return time.perf_counter() - t0

            # By time as well as by count: the first hundred or so small steps
            # run slower (allocator and interpreter warming up) in both.
            for budget_s, count, keep in ((warmup[0], warmup[1], False), (steps[0], steps[1], True)):
                times, end = [], time.perf_counter() + budget_s
                while len(times) < count or (time.perf_counter() < end and len(times) < 2000):
                    times.append(step())
            out.put((statistics.median(times), len(times)))
    finally:
        rpc.shutdown()


def _run(impl, case, warmup, steps, timeout):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(impl, r, port, case, warmup, steps, out),
                         daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=timeout)
    except Exception:
        return None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    # (seconds at least, steps at least)
    warmup, steps = ((0.2, 5), (0.5, 20)) if args.quick else ((2.0, 20), (4.0, 30))
    repeat = 1 if args.quick else args.repeat
    print(f"median step time (ms) over at least {steps[0]:g} s and {steps[1]} steps, after "
          f"{warmup[0]:g} s and {warmup[1]} steps of warm-up; median of {repeat} interleaved "
          f"runs")
    print(f"{'case':<48} {'ucxrpc':>8} {'torch':>8} {'ucxrpc/torch':>13}")
    for case in CASES:
        got = {"ucxrpc": [], "torch": []}
        for _ in range(repeat):
            for impl in got:
                r = _run(impl, case, warmup, steps, timeout=300)
                if r is not None:
                    got[impl].append(r[0] * 1e3)
        med = {k: statistics.median(v) if v else float("nan") for k, v in got.items()}
        print(f"{case[0]:<48} {med['ucxrpc']:>8.2f} {med['torch']:>8.2f} "
              f"{med['ucxrpc'] / med['torch']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
