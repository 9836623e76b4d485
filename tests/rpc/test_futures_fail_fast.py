"""``torch.futures.wait_all`` and ``collect_all`` over ucxrpc's futures fail
as soon as one fails, with the remote exception's own type, as over torch's
RPC (ucxrpc/_torch_futures.py): ucxrpc fails a future with
``Future.set_exception``, which torch's own versions do not see as a
failure until every other future completed."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

_release = threading.Event()


def blocked():
    """Returns once a later call releases it (or after 60 s)."""
    _release.wait(60)
    return 1


def release():
    _release.set()


def fails():
    raise ValueError("the remote ValueError")


def _fail_fast(rank, world_size, init_method):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    out = None
    if rank == 0:
        out = []
        slow = rpc.rpc_async("worker1", blocked)
        for collect in (torch.futures.wait_all,
                        lambda futs: torch.futures.collect_all(futs).wait()):
            with pytest.raises(ValueError, match="the remote ValueError"):
                collect([slow, rpc.rpc_async("worker1", fails), slow])
            out.append(slow.done())
        # A builtin's error, as torch words it, comes out as its RuntimeError.
        with pytest.raises(RuntimeError, match="must match the size"):
            torch.futures.wait_all([slow, rpc.rpc_async("worker1", torch.add,
                                                         (torch.ones(2), torch.ones(3)))])
        out.append(slow.done())
        rpc.rpc_sync("worker1", release)
        # Futures that all succeed: every value, in order.
        out.append(torch.futures.wait_all([slow] + [rpc.rpc_async("worker1", torch.add, (i, 1))
                                                    for i in range(3)]))
        out.append(torch.futures.collect_all([]).wait())
    rpc.shutdown()
    return out


def test_wait_all_and_collect_all_fail_as_soon_as_one_call_fails():
    # The slow call is still running each time the failure comes out.
    assert run_workers(_fail_fast, 2, timeout=100)[0] == [False, False, False, [1, 1, 2, 3], []]
