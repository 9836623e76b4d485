"""The paths CUDA buffers take when a pipe cannot carry device memory
(staging through host chunks) and when a message has many small ones
(packing), run on the CPU: ``UCXRPC_DEBUG_HOST_AS_DEVICE=1`` sends host
buffers down the same code, over real pipes between real processes.  The GPU
tests run the CUDA copies themselves (tests/rpc/test_cuda_rpc.py)."""

from __future__ import annotations

import pytest
import torch

from tests.rpc._digest import digest as _digest
from tests.rpc._digest import digest_and_echo
from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

DEBUG = {"UCXRPC_DEBUG_HOST_AS_DEVICE": "1"}


def _payloads():
    g = torch.Generator().manual_seed(5)
    many = {f"p{i}": torch.randint(-100, 100, (i % 7 + 1, 33), generator=g).to(dtype)
            for i, dtype in enumerate([torch.float32, torch.int64, torch.float16, torch.bool,
                                       torch.bfloat16, torch.int8, torch.complex64] * 6)}
    return {
        # 9 MiB + 1 byte: three chunks, the last one short
        "large": torch.randint(0, 255, ((9 << 20) + 1,), dtype=torch.uint8, generator=g),
        "many": many,
        "mixed": [torch.randn(300_000, generator=g), many, torch.empty(0), "text"],
        "empty": torch.empty(0, 3),
    }


def _staged_echo(rank, world_size, init_method):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    out = {}
    if rank == 0:
        for name, obj in _payloads().items():
            remote_digest, back = rpc.rpc_sync("worker1", digest_and_echo, (obj,))
            out[name] = (remote_digest == _digest(obj), _digest(back) == _digest(obj))
        out["pipe"] = rpc.get_pipe_info("worker1")[0]["cuda_path"]
    rpc.shutdown()
    return out


def path_stats():
    import ucxrpc as rpc

    info = rpc._get_debug_info()
    return {k: info[k] for k in ("staged_bytes", "packed_buffers")}


def _stats_after(rank, world_size, init_method):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    out = None
    if rank == 0:
        payloads = _payloads()
        # Transposed, so not contiguous: small host tensors that are travel
        # in one bundle buffer per dtype instead, as small CUDA tensors never
        # do; these go one buffer each, as CUDA ones would, and get packed.
        strided = {f"s{i}": (torch.arange(66.0) + i).view(2, 33).t()
                   for i in range(42)}
        rpc.rpc_sync("worker1", digest_and_echo, (strided,))
        rpc.rpc_sync("worker1", digest_and_echo, (payloads["many"],))
        rpc.rpc_sync("worker1", digest_and_echo, (payloads["large"],))
        out = [path_stats(), rpc.rpc_sync("worker1", path_stats)]
    rpc.shutdown()
    return out


def test_staged_and_packed_messages_arrive_intact():
    res = run_workers(_staged_echo, 2, timeout=90, env=DEBUG)
    got = res[0]
    assert got.pop("pipe") == "staged"
    assert got == {name: (True, True) for name in _payloads()}, got


def test_the_debug_switch_really_takes_the_staged_and_packed_paths():
    res = run_workers(_stats_after, 2, timeout=90, env=DEBUG)
    caller, callee = res[0]
    # 42 small tensors go out as one pack each way; 9 MiB of chunks each way
    assert caller["packed_buffers"] >= 42 and callee["packed_buffers"] >= 42, res
    assert caller["staged_bytes"] >= 9 << 20 and callee["staged_bytes"] >= 9 << 20, res


def test_without_the_switch_host_buffers_take_the_plain_path():
    res = run_workers(_stats_after, 2, timeout=90)
    assert all(r == {"staged_bytes": 0, "packed_buffers": 0} for r in res[0]), res
