"""CUDA tensors over RPC along device maps (two processes sharing one GPU).

Marked ``gpu``: skipped without one.  Run on a GPU machine with
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64"]


def _init(rank, world_size, init_method, maps):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method,
                                                              device_maps=maps.get(rank)))


def describe(t):
    return str(t.device), t.dtype, t.sum().item() if t.dtype != torch.bool else int(t.sum())


def plus_one(t):
    return t + 1


def sample(dtype_name, n=1 << 16):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2 if dtype is torch.bool else 100, (n,), generator=g)
    return x.to(dtype)


def _cuda_both_ways(rank, world_size, init_method):
    import ucxrpc as rpc

    _init(rank, world_size, init_method, {0: {"worker1": {0: 0}}})
    if rank == 0:
        for name in DTYPES:
            t = sample(name).cuda()
            # the callee sees it on cuda:0 (the map), the reply comes back there
            assert rpc.rpc_sync("worker1", describe, (t,)) == describe(t), name
            if t.dtype is not torch.bool:
                back = rpc.rpc_sync("worker1", plus_one, (t,))
                assert back.device == torch.device("cuda:0")
                assert torch.equal(back, t + 1), name
        # stream discipline: the producer kernel is still running when the RPC goes
        big = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(100_000_000)  # about 50-100 ms of GPU time on the stream
        big.add_(3)
        assert rpc.rpc_sync("worker1", describe, (big,))[2] == 3 * (1 << 20)
    else:
        # worker1 has no map to worker0: CUDA tensors it sends are refused clearly
        with pytest.raises(RuntimeError, match="no device map entry covers cuda:0"):
            rpc.rpc_sync("worker0", describe, (torch.ones(4, device="cuda"),))
    rpc.shutdown()


def test_cuda_tensors_follow_the_device_map():
    run_workers(_cuda_both_ways, 2, timeout=150)


def where(t):
    return str(t.device)


def make_cuda(n):
    return torch.full((n,), 7.0, device="cuda")


def _to_cpu(rank, world_size, init_method):
    import ucxrpc as rpc

    # worker0's cuda:0 lands on worker1's CPU; worker1's replies come back on cuda:0
    _init(rank, world_size, init_method, {0: {"worker1": {0: "cpu"}}})
    if rank == 0:
        t = torch.arange(1000, dtype=torch.float32, device="cuda")
        assert rpc.rpc_sync("worker1", where, (t,)) == "cpu"
        assert torch.equal(rpc.rpc_sync("worker1", plus_one, (t,)).cpu(), t.cpu() + 1)
    rpc.shutdown()


def test_cuda_mapped_to_cpu():
    run_workers(_to_cpu, 2, timeout=150)
