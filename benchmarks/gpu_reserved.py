#!/usr/bin/env python
"""What received device tensors leave cached: ``memory_reserved`` after many
16 MiB receives, on ucxrpc and on torch's TensorPipe agent (the CUDA path
review of 2026-11-29, finding 6).

ucxrpc allocates every receive on a stream of its own (transport/cuda/side.py),
so that a block a user freed with work pending is never handed to UCX.  The
caching allocator keeps free blocks per stream: what receives leave cached
there cannot serve the user's allocations on other streams, and the reverse.
This measures the cost: worker0 calls worker1 ``--calls`` times for a fresh
CUDA tensor of ``--mib`` MiB (device maps cuda:0 -> cuda:0), keeping the last
``--keep`` results alive as a training step keeps activations, then makes
as many allocations of its own; it prints one JSON object per agent with
worker0's ``memory_allocated`` and ``memory_reserved`` (MiB) at the start,
after the receives, and after its own allocations.

    python benchmarks/gpu_reserved.py [--agents ucxrpc,torch] [--calls 1000]

``--device cpu`` runs the same calls on host tensors (no figures): the
script's own machinery, on any machine.  benchmarks/gpu_check.sh's
``reserved`` step runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.multiprocessing as mp


def fresh(nbytes: int, device: str) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)


def _mib(x: int) -> float:
    return round(x / (1 << 20), 1)


def _memory(device: str) -> dict[str, float]:
    if device == "cpu":
        return {"allocated": 0.0, "reserved": 0.0}
    torch.cuda.synchronize()
    return {"allocated": _mib(torch.cuda.memory_allocated()),
            "reserved": _mib(torch.cuda.memory_reserved())}


def _run(rank: int, agent: str, port: int, args: argparse.Namespace) -> None:
    if agent == "ucxrpc":
        import ucxrpc as rpc
        maps = {} if args.device == "cpu" else {"device_maps": {f"w{1 - rank}": {0: 0}}}
        opts = rpc.UcxRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **maps)
    else:
        import torch.distributed.rpc as rpc  # type: ignore[no-redef]
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        if args.device != "cpu":
            opts.set_device_map(f"w{1 - rank}", {0: 0})
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        nbytes = args.mib << 20
        rpc.rpc_sync("w1", fresh, (nbytes, args.device))  # warm
        out = {"agent": agent, "calls": args.calls, "mib": args.mib, "keep": args.keep,
               "start": _memory(args.device)}
        kept: list[torch.Tensor] = []
        for _ in range(args.calls):
            kept.append(rpc.rpc_sync("w1", fresh, (nbytes, args.device)))
            del kept[:-args.keep]
        out["after_receives"] = _memory(args.device)
        kept.clear()
        # The user's own allocations on the default stream, as many again.
        mine = [torch.empty(nbytes, dtype=torch.uint8, device=args.device)
                for _ in range(args.keep)]
        out["after_own"] = _memory(args.device)
        del mine
        print(json.dumps(out), flush=True)
    rpc.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default="ucxrpc,torch")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--keep", type=int, default=8, help="results kept alive at a time")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--port", type=int, default=29731)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for i, agent in enumerate(args.agents.split(",")):
        mp.spawn(_run, args=(agent, args.port + i, args), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
