"""Callbacks on a call's future may wait for other calls (torch runs them on
its RPC thread pool, never on the thread that delivers replies)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def raise_value_error(msg):
    raise ValueError(msg)


def _callbacks(rank, world_size, init_method):
    import ucxrpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.UcxRpcBackendOptions(init_method=init_method))
    if rank == 0:
        dst = "worker1"

        def add_one_more(fut):  # waits for a second call inside the callback
            inner = rpc.rpc_async(dst, torch.add, args=(fut.wait(), 1), timeout=5)
            return inner.then(lambda f: f.wait() + 1).wait()

        fut = rpc.rpc_async(dst, torch.add, args=(torch.ones(2), 1))
        assert isinstance(fut, torch.futures.Future)
        assert torch.equal(fut.then(add_one_more).wait(), torch.full((2,), 4.0))

        # add_done_callback, with rpc_sync inside, many at once
        got, done = [], threading.Event()
        lock = threading.Lock()

        def record(fut):
            value = rpc.rpc_sync(dst, torch.mul, args=(fut.wait(), 2), timeout=5)
            with lock:
                got.append(value)
                if len(got) == 20:
                    done.set()

        for i in range(20):
            rpc.rpc_async(dst, torch.add, args=(torch.tensor(i), 0)).add_done_callback(record)
        assert done.wait(30)
        assert sorted(int(v) for v in got) == [2 * i for i in range(20)]

        # a failure reaches the callback with its own type
        def reraise(fut):
            with pytest.raises(ValueError, match="from worker1"):
                fut.wait()
            return rpc.rpc_sync(dst, torch.add, args=(torch.zeros(1), 7), timeout=5)

        out = rpc.rpc_async(dst, raise_value_error, args=("from worker1",)).then(reraise)
        assert torch.equal(out.wait(), torch.full((1,), 7.0))
        # plain waits and rpc_sync are unchanged
        assert torch.equal(rpc.rpc_async(dst, torch.add, args=(torch.ones(1), 1)).wait(),
                           torch.full((1,), 2.0))
        with pytest.raises(ValueError, match="plain"):
            rpc.rpc_async(dst, raise_value_error, args=("plain",)).wait()
    rpc.shutdown()


def test_callbacks_may_wait_for_other_calls():
    run_workers(_callbacks, 2, timeout=100)
