"""Bundled small tensors over real pipes between real processes: a message
of every dtype and shape, views, empty tensors and large ones, echoed and
checked on both sides; once plainly and once with the host-as-device debug
switch, where the bundle buffers take the staged path CUDA buffers take
when a pipe cannot carry device memory."""

from __future__ import annotations

import pytest
import torch

from tests.rpc._digest import digest as _digest
from tests.rpc._digest import digest_and_echo
from tests.workers import run_workers

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]


def _message():
    g = torch.Generator().manual_seed(3)
    msg = {}
    for i, dtype in enumerate(DTYPES):
        raw = torch.randint(0, 100, (4 + i, 3), generator=g)
        msg[f"m{i}"] = (raw % 2 == 0) if dtype is torch.bool else raw.to(dtype)
        msg[f"s{i}"] = msg[f"m{i}"][1].clone()           # 1-D
        msg[f"z{i}"] = msg[f"m{i}"][0, 0].clone()        # 0-D
    base = torch.randn(20_000, generator=g)
    msg.update(slice=base[10:500], empty=torch.empty(0, 2), large=torch.randn(300_000, generator=g),
               many=[torch.full((1024,), float(i)) for i in range(100)], text="text")
    return msg


def _echo(rank, world_size, init_method):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    out = {}
    if rank == 0:
        msg = _message()
        remote, back = rpc.rpc_sync("worker1", digest_and_echo, (msg,))
        out = {"sent": remote == _digest(msg), "back": _digest(back) == _digest(msg),
               "again": _digest(rpc.rpc_sync("worker1", digest_and_echo, (back,))[1])
               == _digest(msg)}
    rpc.shutdown()
    return out


@pytest.mark.parametrize("env", [None, {"UCXRPC_DEBUG_HOST_AS_DEVICE": "1"}],
                         ids=["plain", "host-as-device"])
def test_bundled_message_arrives_intact_both_ways(env):
    res = run_workers(_echo, 2, timeout=90, env=env)
    assert res[0] == {"sent": True, "back": True, "again": True}, res[0]
