"""Device maps checked job-wide at init, as torch does: every worker raises
the same error naming the worker at fault.  CPU entries need no GPU."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def _try_init(rank, world_size, init_method, maps):
    import ucxrpc as rpc

    opts = rpc.UcxRpcBackendOptions(init_method=init_method, rpc_timeout=20,
                                    device_maps=maps.get(rank))
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=opts)
    except ValueError as exc:
        return str(exc)
    from ucxrpc import api
    members = api._current().members
    out = {"maps": {k: {str(s): str(d) for s, d in m.items()}
                    for k, m in members.device_maps.items()},
           "reverse": {k: {str(s): str(d) for s, d in m.items()}
                       for k, m in members.reverse_device_maps.items()},
           "echo": rpc.rpc_sync(f"worker{1 - rank}", torch.add, (torch.ones(2), rank)).tolist()}
    rpc.shutdown()
    return out


@pytest.mark.parametrize("maps, message", [
    ({0: {"nobody": {"cpu": "cpu"}}}, "Node worker0 has invalid target node names"),
    # index 99 exists on no machine (and no CUDA index on a CPU-only one)
    ({1: {"worker0": {99: 0}}}, "Node worker1 has source devices with invalid indices"),
])
def test_bad_device_maps_fail_init_on_every_worker(maps, message):
    res = run_workers(_try_init, 2, args=(maps,), timeout=60)
    assert all(isinstance(r, str) and message in r for r in res), res


def test_cpu_device_maps_and_their_reverse():
    res = run_workers(_try_init, 2, args=({0: {"worker1": {"cpu": "cpu"}}},), timeout=60)
    assert res[0]["maps"] == {1: {"cpu": "cpu"}} and res[0]["reverse"] == {}
    assert res[1]["maps"] == {} and res[1]["reverse"] == {0: {"cpu": "cpu"}}
    assert res[0]["echo"] == [1.0, 1.0] and res[1]["echo"] == [2.0, 2.0]
