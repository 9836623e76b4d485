"""Helpers shared by the GPU tests of tests/rpc (two processes on one GPU)."""

from __future__ import annotations

import torch

N = 1 << 22          # 16 MiB of float32
SPIN = 200_000_000   # torch.cuda._sleep cycles: about 100 ms on an H100

# cuda:0 -> cuda:0 both ways: the two processes share the one GPU.
BOTH = {0: {"worker1": {0: 0}}, 1: {"worker0": {0: 0}}}


def init(rank, world_size, init_method, maps, **extra):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(
                     init_method=init_method, device_maps=maps.get(rank), **extra))


def checksum(t):
    return float(t.double().sum().item())


def slow_fives(n):
    """A result whose kernels are still queued when the function returns."""
    x = torch.zeros(n, device="cuda")
    torch.cuda._sleep(SPIN)
    x.add_(5)
    return x
